"""``labkit plan`` as a user types it: bad arguments are one line before any work, the exit code
says whether the asked-for strategy fits, and a Hugging Face config.json is a model (in-process)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from labkit.cli import main

CONFIGS = Path(__file__).parent / "data" / "configs"
GPT3 = ["plan", "--layers", "96", "--hidden", "12288", "--heads", "96", "--gpus", "1024", "--global-batch", "1536"]
ONE = ["--tp", "8", "--pp", "16", "--dp", "8", "--microbatch-size", "1"]


def plan(argv, capsys):
    """(exit code, stdout, stderr); argparse's own errors exit through SystemExit."""
    try:
        rc = main(argv)
    except SystemExit as exc:
        rc = exc.code
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.mark.parametrize("extra, message", [
    (["--gpus-per-node", "0"], "--gpus-per-node=0 must be a whole number ≥ 1"),
    (["--top", "-1"], "--top=-1 must be"),
    (["--top", "0"], "--top=0 must be"),
    (["--global-batch", "-8"], "--global-batch=-8"),
    (["--microbatch-size", "0", *ONE[:6]], "--microbatch-size=0"),
    (["--top", "many"], "invalid int value: 'many'"),
    (["--json", "/nonexistent/p.json"], "/nonexistent does not exist"),
    (["--model-config", str(CONFIGS / "llama3-8b.json")], "--layers --hidden --heads describe a GPT"),
])
def test_a_bad_argument_is_one_line_and_exit_2_before_any_work(extra, message, capsys):
    rc, out, err = plan(GPT3 + extra, capsys)
    assert rc == 2 and out == ""                         # nothing ranked or predicted first
    assert message in err and err.count("\n") == 1


def test_json_that_is_a_folder_is_refused_first(tmp_path, capsys):
    rc, out, err = plan(GPT3 + ["--json", str(tmp_path)], capsys)
    assert rc == 2 and out == "" and "is a folder" in err


def test_one_strategy_that_does_not_fit_exits_1_and_says_what_fits_means(capsys):
    rc, out, _ = plan(GPT3 + ONE[:-1] + ["2"], capsys)          # two sequences a micro-batch
    assert rc == 1 and "DOES NOT FIT" in out
    assert "fits = at most 92% of 85.9 GB (81920 MiB) = 79.0 GB per GPU" in out
    rc, out, _ = plan(GPT3 + ONE[:-1] + ["2", "--recompute", "full"], capsys)
    assert rc == 0 and "— fits;" in out and "79.0 GB" in out


def test_the_readme_example_fits(capsys, tmp_path):
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    line = " ".join(readme.split("`.venv/bin/labkit plan ")[1].split("`")[0].split())
    extra = " ".join(readme.split("add `")[1].split("`")[0].split()).replace("p.json", str(tmp_path / "p.json"))
    rc, out, _ = plan(["plan", *line.split(), *extra.split()], capsys)
    assert rc == 0 and "— fits;" in out
    assert json.loads((tmp_path / "p.json").read_text())["fits"] is True


def test_a_hf_config_is_ranked_and_predicted(tmp_path, capsys):
    cfg = ["plan", "--model-config", str(CONFIGS / "mixtral-8x7b.json"), "--seq", "4096", "--gpus", "64",
           "--hardware", "h100", "--global-batch", "256"]
    rc, out, _ = plan(cfg + ["--top", "2", "--json", str(tmp_path / "r.json")], capsys)
    assert rc == 0 and "46.70 B parameters, 12.88 B active" in out and "experts replicated over dp (ep=1)" in out
    assert len(json.loads((tmp_path / "r.json").read_text())) == 2
    rc, out, _ = plan(cfg + ["--tp", "2", "--pp", "8", "--dp", "4", "--microbatch-size", "2", "--zero", "1"], capsys)
    assert rc == 0 and "dp4 pp8 tp2 z1 mbs2" in out
    rc, out, _ = plan(cfg + ["--tp", "2", "--pp", "4", "--dp", "4", "--cp", "2", "--ep", "2", "--zero", "1"], capsys)
    assert rc == 0 and "experts spread over 2 ep ranks (4 per rank)" in out and "dp4 pp4 cp2 tp2" in out


def test_an_unsupported_config_is_one_line(capsys):
    rc, out, err = plan(["plan", "--model-config", str(CONFIGS / "deepseek-v3.json"), "--gpus", "64",
                         "--global-batch", "64"], capsys)
    assert rc == 2 and out == "" and "MLA" in err and err.count("\n") == 1


def test_a_config_that_is_a_json_list_is_one_line_and_exit_2(tmp_path, capsys):
    listed = tmp_path / "list.json"
    listed.write_text(json.dumps([json.loads((CONFIGS / "llama3-8b.json").read_text())]))
    rc, out, err = plan(["plan", "--model-config", str(listed), "--gpus", "64", "--global-batch", "64"], capsys)
    assert rc == 2 and out == "" and "holds a JSON list, not an object" in err and err.count("\n") == 1


def test_published_megatron_2022_table_prints(capsys):
    rc, out, _ = plan(["plan", "--published", "mlsys23"], capsys)
    assert rc == 0 and "1000B" in out and "sp rc:selective" in out and "mean |error|" in out


def test_published_llama_table_prints(capsys):
    rc, out, _ = plan(["plan", "--published", "llama"], capsys)
    assert rc == 0 and "Llama 3 T4" in out and "torchtitan A100" in out and "cp:allgather" in out
