"""The documentation says what the code does: docs/io.md's snippet runs as written, the error
table matches mori.errors, documented defaults match the code, the README and docs list the
examples, no document points outside the repository, and scripts/test.sh does what the docs say
(its own .venv-test, a line before installing system packages, MORI_REQUIRE_URING)."""

from __future__ import annotations

import builtins
import inspect
import re
import subprocess
import sys
from pathlib import Path

from mori import errors

ROOT = Path(__file__).resolve().parent.parent


def _read(rel: str) -> str:
    return (ROOT / rel).read_text()


def _flat(text: str) -> str:
    """Text with line breaks and runs of spaces as single spaces (wrapped prose compares)."""
    return " ".join(text.split())


def _python_blocks(markdown: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```$", markdown, flags=re.S | re.M)


def test_the_io_model_snippet_runs_as_written(tmp_path):
    model = _read("docs/io.md").split("## Model", 1)[1].split("\n## ", 1)[0]
    blocks = _python_blocks(model)
    assert len(blocks) == 1, "docs/io.md's Model section has one python block"
    script = tmp_path / "io_model.py"
    script.write_text(blocks[0])
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr


def test_the_error_table_matches_mori_errors():
    section = _read("docs/foundation.md").split("## Errors", 1)[1]
    documented = re.findall(r"^\| `(\w+)` \|", section, flags=re.M)
    assert sorted(documented) == sorted(errors.__all__)
    assert len(documented) == len(set(documented))
    defined = {n for n, c in vars(errors).items() if inspect.isclass(c) and issubclass(c, errors.MoriError)}
    assert defined == set(errors.__all__), "every error class is exported (and documented)"
    for name, also in re.findall(r"^\| `(\w+)` \|[^|]*\|([^|]*)\|", section, flags=re.M):
        for builtin, base in re.findall(r"(the builtin )?`(\w+)`", also):
            cls = getattr(builtins, base) if builtin else getattr(errors, base, None) or getattr(builtins, base)
            assert issubclass(getattr(errors, name), cls), f"{name} is documented as a {base}"
    assert issubclass(errors.ArgumentTypeError, TypeError) and issubclass(errors.ArgumentTypeError, errors.InvalidArgumentError)


def test_the_documented_ssd_io_default_is_the_codes(tmp_path):
    umbp = _flat(_read("docs/umbp.md"))
    stated = re.search(r"Hence the default `(\w+)`", umbp).group(1)
    assert f"`ssd_io` / `UMBP_SSD_IO` / `--ssd-io` = `{stated}` (the default" in umbp
    env_row = next(line for line in _read("docs/environment.md").splitlines() if line.startswith("| `UMBP_SSD_IO`"))
    assert env_row.rstrip().endswith(f"| `{stated}` |"), env_row
    from mori.umbp import Client

    assert inspect.signature(Client).parameters["ssd_io"].default == stated
    assert f'`"{stated}"` by default' in umbp
    with Client(dram_bytes="1M", ssd_dir=tmp_path / "ssd") as c:
        assert c.stats()["ssd_io"] == stated
    r = subprocess.run([sys.executable, "-m", "mori.umbpd", "--check-config", "--ssd-dir", str(tmp_path / "d")],
                       capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr
    assert re.search(rf"ssd_io +=.*{stated} \(default\)", r.stdout), r.stdout


def test_examples_are_listed_in_the_readme_and_io_docs():
    readme = _read("README.md")
    layout = readme.split("## Layout", 1)[1]
    assert re.search(r"^examples/ ", layout, flags=re.M), "examples/ in the README layout"
    for example in sorted((ROOT / "examples").glob("*.py")):
        name = example.name
        assert name in layout or (name.startswith("triton_") and "triton_*.py" in layout), name
    assert "examples/kv_handoff.py" in _read("docs/io.md")


def test_no_document_points_outside_the_repository():
    texts = {p: p.read_text() for p in [*ROOT.glob("*.md"), *ROOT.glob("docs/*.md"), *ROOT.glob("benches/*.md")]}
    texts.update({p: p.read_text() for p in [*ROOT.glob("python/mori/**/*.py"), *ROOT.glob("scripts/*.sh")]})
    for path, text in texts.items():
        assert "../shared" not in text, f"{path.relative_to(ROOT)} points at ../shared"
    dev = _read("docs/development.md")
    assert not re.search(r"\(\.\./", dev) and "`../" not in dev
    for needed in ("cargo", "Python", "redis-server"):
        assert needed in dev, f"docs/development.md says {needed} is needed"


def test_the_bench_out_default_is_documented():
    from mori.bench._common import DEFAULT_OUT

    phrase = f"`{DEFAULT_OUT}` under the current directory"
    assert phrase in _flat(_read("docs/foundation.md"))
    assert phrase in _flat(_read("README.md"))


def test_the_test_script_keeps_its_own_venv_and_says_what_it_installs():
    script = _read("scripts/test.sh")
    assert "VENV=.venv-test" in script
    code = [line for line in script.splitlines() if not line.lstrip().startswith("#")]
    assert not any(re.search(r"(^|[\s\"'$/])\.venv(/|\b)(?!-test)", line) for line in code), "test.sh touches .venv"
    apt = next(i for i, line in enumerate(code) if line.strip().startswith("apt-get"))
    before = [line for line in code[:apt] if line.strip()]
    assert re.match(r"\s*echo .*install", before[-1]), "a line is printed before apt-get installs anything"
    assert "export MORI_REQUIRE_URING=1" in script and "uring_probe" in script
    assert "/.venv-test/" in _read(".gitignore").splitlines()
    assert "scripts/test.sh" in _read(".ci/run")
    assert ".venv-test" in _read("README.md") and ".venv-test" in _read("docs/development.md")
