"""The ``verl-oar`` console script (verl_oar/app/cli.py): its help lists the commands, each command is its
module's own ``main`` with the arguments passed on unchanged, and the installed script is the same entry."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from verl_oar.app import cli

COMMANDS = ("demo", "check", "compare", "heatmap", "prepare-model")


def test_help_lists_every_command_without_loading_verl_or_torch():
    code = ("import sys; from verl_oar.app import cli; status = cli.main(['--help']); "
            "heavy = [m for m in sys.modules if m.split('.')[0] in ('torch', 'verl', 'transformers')]; "
            "print('HEAVY', heavy); raise SystemExit(status)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "HEAVY []" in out.stdout
    lines = out.stdout.splitlines()
    assert lines[0] == "usage: verl-oar <command> [args...]"
    for name in COMMANDS:
        assert any(line.startswith(f"  {name} ") for line in lines), name


def test_an_unknown_command_exits_2_with_the_list(capsys):
    assert cli.main(["chek"]) == 2
    err = capsys.readouterr().err
    assert "unknown command 'chek'" in err and "compare" in err


@pytest.mark.parametrize("name", COMMANDS)
def test_each_command_is_its_modules_main_with_the_arguments_passed_on(name, capsys):
    """``verl-oar <name> --help`` is the module's own parser (its prog or usage line), exit 0."""
    with pytest.raises(SystemExit) as done:
        cli.main([name, "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    module = {"demo": "verl_oar.testbed.demo", "check": "verl_oar.tools.check", "compare": "verl_oar.app.compare",
              "heatmap": "verl_oar.tools.heatmap", "prepare-model": "verl_oar.tools.prepare_model"}[name]
    assert cli.COMMANDS[name][0] == module
    assert out.startswith("usage: ") and "--" in out  # argparse's help of that module


def test_the_exit_status_of_a_command_is_the_scripts(tmp_path, capsys):
    """check's refusal (1) and compare's success (0) come back through the dispatcher."""
    config = Path(cli.__file__).resolve().parents[2] / "recipes" / "config"
    status = cli.main(["check", "--config-path", str(config), "--config-name", "qwen2_5_math_1_5b_oar_g",
                       "+algorithm.oar.tauu=1"])
    out = capsys.readouterr().out
    assert status == 1 and "REFUSED (verl-oar): Unknown key(s) algorithm.oar.tauu" in out
    run = tmp_path / "grpo_seed0.jsonl"
    run.write_text("".join(f'{{"step": {s}, "data": {{"critic/score/mean": {s / 4}}}}}\n' for s in range(1, 5)))
    assert cli.main(["compare", str(run), "--resamples", "10"]) == 0
    assert "grpo" in capsys.readouterr().out


def test_the_installed_console_script():
    """After ``pip install -e .`` the environment has ``verl-oar`` (pyproject's [project.scripts])."""
    script = Path(sys.executable).parent / "verl-oar"
    if not script.exists():
        script = shutil.which("verl-oar")
    if script is None:
        pytest.skip("verl-oar is not installed in this environment: pip install -e . --no-deps")
    out = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert all(f"  {name} " in out.stdout for name in COMMANDS)
