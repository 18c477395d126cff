"""The README's commands are the ones CI and GPU users run: the test command is .ci/run's, the CPU-only
torch install is explained, the GPU script is a plain one, and the benches it lists exist."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def test_ci_runs_the_readme_test_command():
    blocks = re.findall(r"```bash\n(.*?)```", README, flags=re.S)
    test_cmd = next(b.strip() for b in blocks if "pytest" in b and "'.[test]'" in b)
    ci = (ROOT / ".ci" / "run").read_text()
    assert test_cmd in ci.splitlines()


def test_readme_covers_cpu_torch_gpus_and_open_routes():
    assert "--index-url https://download.pytorch.org/whl/cpu" in README
    assert "## Running on a GPU" in README and "scripts/gpu_run.sh" in README
    assert "lamina bench prefix" in README and "lamina bench gdn-prefill" in README
    assert "`/health` and `/metrics` are always open" in README


def test_test_extra_does_not_pin_triton():
    """PyPI's torch pins its own triton (2.13.0: 3.7.1); a pin of ours would make the install unresolvable."""
    pyproject = (ROOT / "pyproject.toml").read_text()
    triton = [ln for ln in pyproject.splitlines() if '"triton' in ln]
    assert triton and all("==" not in ln.split(";")[0] for ln in triton)


def test_gpu_script_is_plain():
    script = (ROOT / "scripts" / "gpu_run.sh").read_text()
    assert ".gpu_a" not in script and ".whl" not in script  # the transport setup lives apart
    assert (ROOT / "scripts" / "gpu_remote_env.sh").is_file()


def test_bench_commands_in_the_readme_exist():
    from lamina.cli import build_parser

    parser = build_parser()
    for cmd in ("throughput", "latency", "prefix", "gdn-prefill", "serve"):
        assert parser.parse_known_args(["bench", cmd])[0].bench_command == cmd
