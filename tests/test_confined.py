"""What a run, a checkpoint manifest or an export names stays inside it, and every output goes through one atomic
writer (issue 56): no output lands through a symbolic link planted in a workdir, and a failed write (a full disk)
leaves the earlier file whole."""
from __future__ import annotations

import subprocess
import sys

import helpers
import pytest
import tiny_config

from lconv import outputs
from lconv.cli import eval_program
from lconv.errors import UserError
from lconv.infer import decode_and_score
from lconv.run import restore


@pytest.fixture
def config_only(tmp_path, monkeypatch):
    """A workdir holding only a translation run's config.json, and a ``load_trained`` that fails the test."""
    workdir = tmp_path / "run"
    workdir.mkdir()
    (workdir / "config.json").write_text(tiny_config.get_config().to_json())
    monkeypatch.setattr(restore, "load_trained", lambda *a, **k: pytest.fail("loaded before the check"))
    return workdir


@pytest.fixture
def victim(tmp_path):
    path = tmp_path / "victim.txt"
    path.write_text("precious\n")
    return path


def test_eval_refuses_an_output_that_is_a_symlink_before_loading(config_only, victim, tmp_path, capsys):
    (config_only / "test.hyp.txt").symlink_to(victim)
    with pytest.raises(UserError) as error:
        eval_program.run(str(config_only), split="test")
    helpers.one_line_error(error, str(config_only / "test.hyp.txt"), "symbolic link")
    source = tmp_path / "in.en"
    source.write_text("one line\n")
    link = tmp_path / "out.de"
    link.symlink_to(victim)
    helpers.one_line_error(helpers.run_cli(capsys, "eval.py", f"--workdir={config_only}", f"--source_file={source}",
                                           f"--output_file={link}"), str(link), "symbolic link")
    assert victim.read_text() == "precious\n"


def test_the_writers_refuse_a_link_planted_after_the_check(tmp_path, victim):
    """The split's writer itself refuses (a link made between eval.py's check and its write)."""
    (tmp_path / "test.scores.json").symlink_to(victim)
    with pytest.raises(UserError) as error:
        decode_and_score.write_outputs(str(tmp_path), "test", ["a"], {"bleu": 1.0})
    helpers.one_line_error(error, "test.scores.json", "symbolic link")
    assert victim.read_text() == "precious\n"


def test_a_failed_write_keeps_the_earlier_file_and_leaves_no_temporary(tmp_path):
    """``ulimit -f``: the write fails part-way (a full disk); the earlier output is whole, the error one line."""
    path = tmp_path / "output.txt"
    path.write_text("earlier\n")
    code = ("import resource, sys\nresource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))\n"
            "from lconv import outputs\nfrom lconv.errors import UserError\n"
            "try:\n    outputs.write_atomically(sys.argv[1], 'x' * 100000)\n"
            "except UserError as e:\n    print(e)\n    sys.exit(2)\n")
    result = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, cwd=helpers.ROOT,
                            timeout=60)
    assert result.returncode == 2, result.stderr
    assert str(path) in result.stdout and len(result.stdout.strip().splitlines()) == 1
    assert path.read_text() == "earlier\n" and sorted(p.name for p in tmp_path.iterdir()) == ["output.txt"]
    outputs.write_atomically(path, "later\n")
    assert path.read_text() == "later\n"
