"""A workdir on an object store (gs://...): a URL is never turned into a local path (``os.path.abspath`` of
"gs://b/run" is "./gs:/b/run"), append-only files are rewritten whole (object stores cannot append), and the
workdir lock says it cannot protect a remote workdir. Reading and writing go through ``etils.epath``; no store is
reachable from the test machine, so the epath calls themselves run on local paths here."""
import json

from etils import epath

from lconv.run import workdir as workdir_lib
from lconv.train import logs


def test_a_url_workdir_stays_a_url_and_a_local_one_becomes_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert workdir_lib.resolve("gs://bucket/run") == "gs://bucket/run"
    assert workdir_lib.resolve("runs/x") == str(tmp_path / "runs" / "x")
    assert workdir_lib.is_remote("s3://b/r") and not workdir_lib.is_remote("/tmp/r")


def test_a_remote_metrics_file_is_rewritten_whole_and_keeps_earlier_rows(tmp_path):
    path = epath.Path(tmp_path) / "metrics.jsonl"
    path.write_text('{"step": 1}\n')  # a resumed run's earlier rows
    lines = logs._RemoteLines(path)
    lines.write('{"step": 2}\n')
    lines.flush()
    lines.write('{"step": 3}\n')
    lines.close()
    assert [json.loads(r)["step"] for r in path.read_text().splitlines()] == [1, 2, 3]


def test_a_remote_workdir_is_not_locked_and_says_so(lconv_log):
    with workdir_lib.lock("gs://bucket/run"):
        pass
    assert lconv_log() == ["warning: gs://bucket/run is remote: nothing stops a second train.py on it (file "
                           "locks are local only)"]
