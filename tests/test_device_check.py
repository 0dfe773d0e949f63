"""bench/device_check.py, the command ready for the first GPU, runs here at toy size (--toy): every part (train.py's
own loop at both sizes beside the stock step, the bf16 step at doubling batch sizes, the vocabulary loss three ways,
select -> accelerate launch bf16 train.py -> evaluate.py, selection's speed) and writes its report."""

import json

import pytest

from bench import device_check


@pytest.mark.slow
def test_device_check_runs_at_toy_size_on_cpu(tmp_path):
    # part 2's compiled modes: proven in the device's environment (tests/test_device_env.py), eager only here
    report = device_check.main(["--toy", "--out", str(tmp_path), "--memory_sweep", "--modes", "eager"])
    for size, loop in report["loop"].items():  # train.py's own loop: timed, counted, profiled, beside the stock step
        assert loop["host_syncs_per_step"] == 0 and loop["time_per_step_s"] > 0 and loop["tflops_per_s"] > 0, size
        assert 0 <= loop["data_wait_share"] < 1 and loop["aten_ops_per_step"] > 0 and len(loop["top"]) == 8
        assert loop["stock"]["step_s"] > 0 and loop["vs_stock"] > 0 and loop["peak_memory_gib"] is None  # a CPU
    assert set(report["loop"]) == {"bert-base", "harness"}
    assert set(report["loop"]["harness"]["modes"]) == {"eager", "stock eager"}
    assert report["step"]["groups"] == 8 and report["step"]["tflops_per_s"] > 0  # 2, 4, 8 groups all fit
    vocab = report["vocab"]
    assert set(vocab) >= {"ours fused", "plain"}
    assert abs(vocab["ours fused"]["loss"] - vocab["plain"]["loss"]) < 1e-3
    assert vocab["ours fused"]["max_grad_diff_vs_plain"] < 1e-4
    assert report["host_syncs"] is None  # CUDA only
    assert report["e2e"]["scifact"] >= 0 and (tmp_path / "run" / "model" / "model.safetensors").exists()
    assert report["selection"]["8"]["tokens_per_s"] > 0 and report["selection"]["8"]["groups"] > 0
    assert json.loads((tmp_path / "device_check.json").read_text())["step"] == report["step"]


def test_device_check_on_a_cpu_says_it_needs_a_gpu(tmp_path, monkeypatch):
    """Without --toy on a machine with no GPU, the device check stops in one line before it builds anything (issue 54
    item 6: it built BERT-base at 128 groups, estimated ~110 GiB, went on and was killed, leaving 420 MB behind)."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "out"
    with pytest.raises(SystemExit, match="device_check measures a GPU .* or with --toy here"):
        device_check.main(["--out", str(out)])
    assert not out.exists()
