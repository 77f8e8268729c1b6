"""mkdocs hook: pages generated at build time from what they document, so the site cannot drift:
the configuration fields, the metrics a run logs and the commands' help
(`megatron_gspo/cli/reference.py`), and the
Docker image's page, which is docker/README.md with its links made to work from the site."""

import re
from pathlib import Path

from mkdocs.structure.files import File

from megatron_gspo.cli import _parser
from megatron_gspo.cli.convert import _parser as convert_parser
from megatron_gspo.cli.reference import cli_reference, config_reference, metrics_reference

ROOT = Path(__file__).resolve().parents[1]


def docker_page() -> str:
    """docker/README.md with its relative links fixed: a link into docs/ becomes a site link, a
    link to another file of the repository becomes that file's path in code."""
    text = (ROOT / "docker" / "README.md").read_text()

    def fix(m: re.Match) -> str:
        label, target = m.group(1), m.group(2)
        if target.startswith(("http://", "https://", "#")):
            return m.group(0)
        if target.startswith("../docs/"):
            return f"[{label}]({target[len('../docs/'):]})"
        path = (Path("docker") / target.split("#")[0]).as_posix().replace("docker/../", "")
        return label if label.strip("`") != target else f"`{path}`"
    return re.sub(r"(?<!!)\[([^\]]+)\]\(([^)\s]+)\)", fix, text)


PAGES = {"reference/config.md": config_reference,
         "reference/metrics.md": metrics_reference,
         "reference/cli.md": lambda: cli_reference(_parser(), convert_parser()),
         "docker.md": docker_page}


def on_files(files, config):
    for uri, make in PAGES.items():
        files.append(File.generated(config, uri, content=make()))
    return files
