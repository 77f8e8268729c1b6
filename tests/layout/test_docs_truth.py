"""What the manual says agrees with the code and the shipped files (issue 57, item 5): every
`examples/...` path it names exists and every config it tells a command to run is shipped; a
`section.field=value` it writes is a value the field accepts and a `section.field` named with
"default" has that default; the fields configuration.md lists in a section's row belong to that
section; memory beside a GiB plan is never given in decimal GB (80GB is 74.5 GiB: 5.5 GiB
apart); and the launch variables a command sets are ones docker/launch/ reads."""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

from megatron_gspo.config import Config

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
LAUNCH = ROOT / "docker" / "launch"
PLACEHOLDERS = {"run.yaml", "CONFIG", "CONFIG.yaml", "STUDY.yaml"}  # "your config" in commands
IMAGE_REPO = "/workspace/megatron-gspo/"  # the repository's copy in the Docker image (WORKDIR)
GENERATED = {"examples/smollm2/base"}  # written by examples/smollm2/prepare.py (ignored by git)


def _pages() -> list[Path]:
    return sorted(DOCS.rglob("*.md")) + [ROOT / "README.md", ROOT / "docker" / "README.md"]


def _rel(p: Path) -> str:
    return p.relative_to(ROOT).as_posix()


def _fields() -> dict[str, dataclasses.Field]:
    """Every config field by its dotted name (`model.lora.rank`)."""
    out = {}

    def walk(cls, prefix):
        for f in dataclasses.fields(cls):
            name = f"{prefix}{f.name}"
            if dataclasses.is_dataclass(f.type) or (isinstance(f.type, str) and f.default_factory
                                                     is not dataclasses.MISSING and
                                                     dataclasses.is_dataclass(f.default_factory)):
                walk(f.default_factory, name + ".")
            else:
                out[name] = f
    walk(Config, "")
    return out


def _default(f: dataclasses.Field):
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


# ---- paths and configs named in the manual -------------------------------------------------

EXAMPLE_RE = re.compile(r"(?<![\w/.-])examples/[\w./-]*[\w/]")


def test_example_paths_named_in_the_docs_exist():
    missing = sorted({f"{_rel(p)}: {m.group(0)}" for p in _pages()
                      for m in EXAMPLE_RE.finditer(p.read_text())
                      if m.group(0).rstrip("/.") not in GENERATED
                      and not (ROOT / m.group(0).rstrip("/.")).exists()})
    assert missing == []


COMMAND_RE = re.compile(
    r"(?:megatron-gspo (?:train|plan|config|study)|(?:torchrun|colocated|slurm)\.(?:sh|sbatch)"
    r"|disaggregated\.sh learner|sbatch(?: --[\w=-]+)*)"
    r"((?: --?[\w-]+(?:=\S+)?)*) (\S+\.yaml|CONFIG)\b")


def named_configs(text: str) -> list[str]:
    """The config file each `megatron-gspo train|plan|config|study` or launch-script command in
    `text` is given (continuation lines joined)."""
    text = re.sub(r"\s*\\\n\s*", " ", text)
    return [m.group(2).removeprefix(IMAGE_REPO) for m in COMMAND_RE.finditer(text)]


def _study(text: str, config: str) -> bool:
    return f"megatron-gspo study {config}" in text


def test_configs_the_docs_launch_are_shipped():
    bad = sorted({f"{_rel(p)}: {c}" for p in _pages() for c in named_configs(p.read_text())
                  if c not in PLACEHOLDERS and not (ROOT / c).is_file()})
    assert bad == []


def test_config_check_sees_an_unshipped_config():
    text = ("NNODES=2 NODE_RANK=0 docker/launch/colocated.sh qwen3_30b_a3b.yaml --run-dir x\n"
            "megatron-gspo plan examples/qwen3_gpu/qwen3_8b_1node.yaml --gpu-memory 80GB\n"
            "docker/launch/colocated.sh --dry-run \\\n    examples/tiny/config.yaml\n")
    assert named_configs(text) == ["qwen3_30b_a3b.yaml", "examples/qwen3_gpu/qwen3_8b_1node.yaml",
                                   "examples/tiny/config.yaml"]


def test_shipped_configs_named_in_the_docs_load():
    from megatron_gspo.config import load_config

    texts = [p.read_text() for p in _pages()]
    named = {c for t in texts for c in named_configs(t)
             if c.startswith("examples/") and not _study(t, c)}
    assert "examples/qwen3_gpu/qwen3_30b_a3b_2nodes.yaml" in named
    for c in sorted(named):
        load_config(str(ROOT / c))


# ---- config values and defaults --------------------------------------------------------------

def test_values_written_in_the_docs_are_accepted():
    fields = _fields()
    bad = []
    for p in _pages():
        for m in re.finditer(r"(?<![\w.])([a-z_]+(?:\.[a-z_]+)+)=([\w.-]+)", p.read_text()):
            f = fields.get(m.group(1))
            choices = f and f.metadata.get("choices")
            if choices and m.group(2) not in map(str, choices):
                bad.append(f"{_rel(p)}: {m.group(0)} (choices {', '.join(map(str, choices))})")
    assert bad == []


NAME = r"[a-z_]+(?:\.[a-z_]+)+"
DEFAULT_RES = (  # `a.b: V` (the default ...)  and  `a.b` [a few words] (default V
    re.compile(rf"`({NAME}): ([^`]+)`\s+\((?:the\s+)?default\b"),
    re.compile(rf"`({NAME})`[\w ]{{0,12}}\(default:?\s+`?([\w.-]+)"))


def said_defaults(text: str) -> list[tuple[str, str]]:
    """(field, value) for each default the text states for a dotted field name."""
    return [(m.group(1), m.group(2).rstrip(".")) for r in DEFAULT_RES for m in r.finditer(text)]


def test_defaults_named_in_the_docs_are_the_code_defaults():
    fields = _fields()
    bad = []
    for p in _pages():
        for name, said in said_defaults(p.read_text()):
            f = fields.get(name)
            if f is None:
                continue
            real = _default(f)
            if real is None or isinstance(real, (list, dict)):
                continue  # worded defaults (`null = on when colocated`, `1, 2, 4, ..., n`)
            if said != str(real) and _num(said) != _num(real) and \
                    not (isinstance(real, bool) and said.lower() == str(real).lower()):
                bad.append(f"{_rel(p)}: {name} default {said}, code {real!r}")
    assert bad == []


def test_default_check_reads_both_forms():
    text = ("`checkpoint.interval: 0` (the\ndefault, a checkpoint only at the end); "
            "`parallel.timeout` seconds (default 1800)")
    assert said_defaults(text) == [("checkpoint.interval", "0"), ("parallel.timeout", "1800")]


def _num(v):
    try:
        return float(v)
    except (TypeError, ValueError):
        return v


def test_configuration_page_rows_name_their_sections_fields():
    """configuration.md's table of sections: every `field` in a row belongs to that section."""
    fields = _fields()
    text = (DOCS / "configuration.md").read_text()
    rows = re.findall(r"^\| `([a-z]+)` \| (.+) \|$", text, re.M)
    assert len(rows) == len(dataclasses.fields(Config))
    bad = []
    for section, cells in rows:
        for name in re.findall(r"`([a-z_]+(?:\.[a-z_*]+)*)`", cells):
            full = name if name.startswith(section + ".") else f"{section}.{name}"
            if full.endswith(".*"):
                ok = any(k.startswith(full[:-1]) for k in fields)
            else:
                ok = full in fields
            if not ok:
                bad.append(f"{section}: {name}")
        if not re.search(r"`[a-z_]", cells):
            bad.append(f"{section}: the row names none of its fields")
    assert bad == []


def test_front_pages_name_the_weight_syncs_a_run_can_choose():
    """README's and index.md's loop diagrams: a sync path a run can take (`rollout.weight_sync`
    has no disk choice) and a probe that is on by default when they say so."""
    fields = _fields()
    choices = fields["rollout.weight_sync"].metadata["choices"]
    assert "disk" not in choices
    for page in (ROOT / "README.md", DOCS / "index.md"):
        said = re.search(r"weight sync to the engines \(([^)]*)\)", page.read_text()).group(1)
        assert "disk" not in said.lower(), f"{_rel(page)}: {said}"
        if "probe" in said:
            assert _default(fields["rollout.verify_sync_interval"]) == 1, _rel(page)


# ---- memory units ----------------------------------------------------------------------------

GB_RE = re.compile(r"(?<![\w.])(\d[\d.,]*) ?GB\b(?!/s)")


def decimal_gb(text: str) -> list[str]:
    """Memory figures in decimal GB that are neither a flag's value (`--gpu-memory 80GB`,
    `GPU_MEMORY=80GB`, a quoted `80GB`) nor a card's name (`80 GB GPUs`, `80 GB H100s`)."""
    out = []
    for m in GB_RE.finditer(text):
        before, after = text[max(0, m.start() - 14):m.start()], text[m.end():m.end() + 7]
        if before.endswith(("--gpu-memory ", "GPU_MEMORY=")) or re.match(r" (GPU|H1|H2|A1|card)",
                                                                          after):
            continue
        if before.endswith("`") and after.startswith("`"):
            continue  # a value quoted as typed (`80GB`)
        out.append(m.group(0))
    return out


def test_no_decimal_gb_beside_gib_plans():
    bad = [f"{_rel(p)}: {g}" for p in _pages() if "GiB" in (t := p.read_text())
           for g in decimal_gb(t)]
    assert bad == []


def test_gb_check_sees_a_gb_table():
    assert decimal_gb("| Qwen3-8B | 36.9 GB | 1 (80 GB) |, on 80 GB GPUs, --gpu-memory 80GB, "
                      "at 12.5 GB/s, or GB (`80GB`)") == ["36.9 GB", "80 GB"]


# ---- launch variables ------------------------------------------------------------------------

VAR_RE = re.compile(r"(?:^|\s)(?:-e )?([A-Z][A-Z0-9_]*)=(\S*)")
SCHEDULER = ("SLURM_",)  # variables the scheduler sets on each node
ELSEWHERE = {"PYTHON", "SDIST_PYTHON", "PIP_EXTRA_INDEX_URL", "CUDA_VISIBLE_DEVICES",
             "NCCL_DEBUG", "NCCL_SOCKET_IFNAME", "NCCL_IB_HCA", "OMP_NUM_THREADS",
             "TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "DOCKER_TIER_KEEP"}  # read by other tools


def _launch_reads() -> set[str]:
    text = "".join(p.read_text() for p in LAUNCH.iterdir() if p.is_file())
    return set(re.findall(r"\$\{?([A-Z][A-Z0-9_]*)", text))


def launch_lines(text: str) -> list[str]:
    """Command lines (continuations joined) of `text`'s code blocks that run a launch script."""
    text = re.sub(r"\s*\\\n\s*", " ", text)
    blocks = re.findall(r"```[a-z]*\n(.*?)```", text, re.S)
    return [line for b in blocks for line in b.splitlines()
            if re.search(r"(torchrun|colocated|disaggregated)\.sh|slurm\.sbatch", line)]


def test_launch_variables_in_the_docs_are_read_by_the_scripts():
    reads = _launch_reads()
    bad = []
    for p in _pages():
        for line in launch_lines(p.read_text()):
            if line.lstrip().startswith(("#", "$ ")) and "=" not in line:
                continue
            for var, value in VAR_RE.findall(line.split("#")[0]):
                if var not in reads and var not in ELSEWHERE:
                    bad.append(f"{_rel(p)}: {var} is not read by docker/launch/")
                for ref in re.findall(r"\$\{?([A-Z][A-Z0-9_]*)", value):
                    if not ref.startswith(SCHEDULER):
                        bad.append(f"{_rel(p)}: {var}=${ref}: nothing sets {ref} on a node")
    assert bad == []


def test_launch_check_sees_an_undefined_variable():
    line = launch_lines("```bash\nNNODES=2 NODE_RANK=$RANK docker/launch/colocated.sh x.yaml\n```")
    assert [v for v in VAR_RE.findall(line[0])] == [("NNODES", "2"), ("NODE_RANK", "$RANK")]


def test_rendezvous_table_names_variables_the_scripts_read():
    text = (DOCS / "multinode.md").read_text()
    table = re.findall(r"^\| `([A-Z_]+)` \|", text, re.M)
    assert "NODE_RANK" in table
    assert sorted(set(table) - _launch_reads()) == []


# ---- pasted plan output ----------------------------------------------------------------------

PLAN_PAGES = ("quickstart-by-hardware.md", "multinode.md")


def pasted_plans(text: str) -> list[tuple[list[str], list[str]]]:
    """(argv after `megatron-gspo`, the lines pasted under it but '...') of each `$ megatron-gspo
    plan ...` in a code block of `text`."""
    out = []
    for block in re.findall(r"```text\n(.*?)```", text, re.S):
        block = re.sub(r"\s*\\\n\s*", " ", block)
        lines = block.splitlines()
        if not lines or not lines[0].startswith("$ megatron-gspo plan "):
            continue
        shown = [ln.rstrip() for ln in lines[1:] if ln.strip() and ln.strip() != "..."]
        out.append((lines[0][len("$ megatron-gspo "):].split(), shown))
    return out


def test_pasted_plans_are_what_plan_prints():
    """Every `megatron-gspo plan` output the pages paste (shortened with '...') is, line for
    line, in what the command prints today."""
    import contextlib
    import io

    from megatron_gspo.cli import main

    cases = [(page, argv, shown) for page in PLAN_PAGES
             for argv, shown in pasted_plans((DOCS / page).read_text())]
    assert len(cases) >= 5
    bad = []
    for page, argv, shown in cases:
        buf, cwd = io.StringIO(), os.getcwd()
        os.chdir(ROOT)
        try:
            with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
                main(argv)
        finally:
            os.chdir(cwd)
        printed = {ln.rstrip() for ln in buf.getvalue().splitlines()}
        bad += [f"{page}: {' '.join(argv)}: {ln}" for ln in shown if ln not in printed]
    assert bad == []


def test_scripts_named_in_the_docs_exist_and_the_guide_names_every_bench():
    named = {(p, m.group(0)) for p in _pages() for m in re.finditer(
        r"(?<![\w/.-])(?:bench|scripts)/[\w/.-]*\.(?:py|sh|sbatch)\b", p.read_text())}
    assert sorted(f"{_rel(p)}: {n}" for p, n in named if not (ROOT / n).is_file()) == []
    guide = (DOCS / "performance.md").read_text()
    benches = {f"bench/{p.name}" for p in (ROOT / "bench").glob("*.py")  # speed benches
               if (t := p.read_text()).startswith('"""Benchmark') or 'print(f"ratio=' in t}
    assert sorted(b for b in benches if f"`{b}`" not in guide) == []
