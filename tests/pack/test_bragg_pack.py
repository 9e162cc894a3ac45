"""Tests of the bragg_pack Python module and the bragg-pack CLI (driven as a real binary)."""

import json
import os
import subprocess
import threading
import time

import numpy as np
import pytest

import bragg_pack as bp

CLI = os.environ.get("BRAGG_PACK_CLI")


def test_plan_outputs_numpy_with_megatron_dtypes():
    lengths = np.array([3, 5, 9, 17, 1, 33], dtype=np.int64)
    p = bp.plan(lengths, dp=2, micro_batches=2, cp=2, tp=2, sp=True)
    s = p.summary
    assert s["traces"] == 6 and s["ranks"] == 2 and s["micro_batches_per_rank"] == 2
    assert s["alignment"] == 8
    seen = []
    for r in range(p.num_ranks):
        for m in range(p.micro_batches_per_rank):
            mb = p.micro_batch(r, m)
            assert mb["cu_seqlens"].dtype == np.int32
            assert mb["cu_seqlens_padded"].dtype == np.int32
            assert mb["trace_ids"].dtype == np.int64
            assert mb["position_ids"].shape == (mb["total_tokens"],)
            assert (np.diff(mb["cu_seqlens_padded"]) % 8 == 0).all()
            seen += mb["trace_ids"].tolist()
            kw = bp.packed_seq_params_kwargs(mb)
            assert kw["qkv_format"] == "thd"
            n = len(mb["trace_ids"]) + 1
            for key in ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded",
                        "cu_seqlens_kv_padded"):
                assert kw[key].dtype == np.int32 and kw[key].shape == (n,)
            assert kw["max_seqlen_q"] == mb["max_seqlen"]
    assert sorted(seen) == list(range(6))
    with pytest.raises(IndexError):
        p.micro_batch(2, 0)


def test_cp_round_trip_of_every_per_token_array():
    cp, layers, top_k = 4, 3, 2
    lengths = np.array([1, 7, 20, 64])
    p = bp.plan(lengths, dp=1, micro_batches=1, cp=cp, fp8=True)
    mb = p.micro_batch(0, 0)
    cu, cup, total = mb["cu_seqlens"], mb["cu_seqlens_padded"], mb["total_tokens"]
    rng = np.random.default_rng(0)
    real = int(cu[-1])
    tokens = pack = bp.pack_to_padded(rng.integers(1, 1000, real), cu, cup, 0)
    experts = bp.pack_to_padded(rng.integers(0, 64, (real, layers, top_k)).astype(np.int16),
                                cu, cup, -1)
    # Routed-expert rows of trace k start at its padded offset, not at its real offset.
    k = 2
    assert (experts[cup[k]:cup[k] + (cu[k + 1] - cu[k])] >= 0).all()
    assert (experts[cup[k] + (cu[k + 1] - cu[k]):cup[k + 1]] == -1).all()
    labels = bp.shift_within_traces(tokens, cu, cup, -100)
    mask = bp.shift_within_traces((tokens > 0).astype(np.float32), cu, cup, 0.0)
    for t in range(len(cu) - 1):
        assert mask[cup[t] + (cu[t + 1] - cu[t]) - 1] == 0  # last token of each trace
    arrays = {"tokens": tokens, "labels": labels, "loss_mask": mask,
              "position_ids": mb["position_ids"], "logprobs": rng.random(total),
              "advantages": rng.random(total).astype(np.float32), "experts": experts}
    idx = [bp.cp_indices(cup, cp, r) for r in range(cp)]
    assert all(len(i) == total // cp for i in idx)
    assert np.array_equal(np.sort(np.concatenate(idx)), np.arange(total))
    for name, a in arrays.items():
        parts = [bp.partition(a, i) for i in idx]
        assert parts[0].shape[1:] == a.shape[1:]
        back = bp.restore(parts, idx, total)
        assert back.dtype == a.dtype and np.array_equal(back, a), name
    assert np.array_equal(bp.unpack_from_padded(experts, cu, cup).shape, (real, layers, top_k))


def test_fp8_per_row_pads_rows_not_traces_and_partitions_exactly():
    rng = np.random.default_rng(7)
    lengths = rng.integers(1, 3000, 200)
    cp, tp = 2, 2
    trace = bp.plan(lengths, dp=4, max_tokens=16384, cp=cp, tp=tp, sp=True, fp8=True)
    row = bp.plan(lengths, dp=4, max_tokens=16384, cp=cp, tp=tp, sp=True, fp8=True,
                  fp8_align="row")
    assert trace.summary["alignment"] == 16 and trace.summary["row_alignment"] == 16
    assert row.summary["alignment"] == 8 and row.summary["row_alignment"] == 64
    assert bp.alignment(cp=cp, tp=tp, sp=True, fp8=True, fp8_align="row") == 8
    assert bp.row_alignment(cp=cp, tp=tp, sp=True, fp8=True, fp8_align="row") == 64
    assert row.summary["padded_tokens"] < trace.summary["padded_tokens"]
    for r in range(row.num_ranks):
        for m in range(row.micro_batches_per_rank):
            mb = row.micro_batch(r, m)
            cup, total = mb["cu_seqlens_padded"], mb["total_tokens"]
            assert total <= 16384 and total % 64 == 0 and cup[-1] == total
            assert (np.diff(cup) % 8 == 0).all()
            for k in range(cp):  # every CP rank, and its SP shards, hold a multiple of 16
                assert len(bp.cp_indices(cup, cp, k)) == total // cp
                assert (total // cp // tp) % 16 == 0
    with pytest.raises(ValueError, match="trace or row"):
        bp.plan(lengths, dp=1, micro_batches=1, fp8=True, fp8_align="sequence")
    with pytest.raises(ValueError, match="needs fp8"):
        bp.plan(lengths, dp=1, micro_batches=1, fp8_align="row")


def test_hostile_inputs_raise_value_error():
    with pytest.raises(ValueError):
        bp.plan(np.array([5, 0]), dp=1, micro_batches=1)
    with pytest.raises(ValueError):
        bp.plan(np.array([5]), dp=1)  # neither max_tokens nor micro_batches
    with pytest.raises(ValueError):
        bp.plan(np.array([100]), dp=1, max_tokens=64)
    with pytest.raises(ValueError):
        bp.plan(np.array([5]), dp=1, micro_batches=1, method="magic")
    with pytest.raises(ValueError):
        bp.plan(np.array([5, 6]), dp=1, micro_batches=1, ids=np.array([1]))
    with pytest.raises(ValueError, match="multiple of 2\\*cp"):
        bp.cp_indices(np.array([0, 8, 18]), 2, 0)
    with pytest.raises(ValueError):
        bp.cp_indices(np.array([0, 8]), 2, 5)
    with pytest.raises(ValueError):
        bp.partition(np.zeros(4), np.array([0, 4]))
    with pytest.raises(ValueError):
        bp.pack_to_padded(np.zeros(3), [0, 4], [0, 4])


def test_gil_is_released_while_planning():
    rng = np.random.default_rng(1)
    lengths = np.clip(rng.lognormal(np.log(2048), 1.0, 300_000), 64, 65536).astype(np.int64)
    ticks = []
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0)

    t = threading.Thread(target=spin)
    t.start()
    time.sleep(0.01)
    begin = time.perf_counter()
    p = bp.plan(lengths, dp=512, max_tokens=131072, fp8=True, cost_b=1.0 / 49152)
    end = time.perf_counter()
    stop.set()
    t.join()
    assert p.summary["traces"] == len(lengths)
    during = [x for x in ticks if begin + 0.002 < x < end - 0.002]
    assert end - begin > 0.01
    assert len(during) > 10, "Python thread did not run while planning"


def test_cost_model_helpers():
    a, b = bp.cost_model_from_model_size(4096, 32)
    assert a / b == pytest.approx(12 * 4096)
    s = np.array([512.0, 1024, 4096, 8192])
    a2, b2, r2 = bp.fit_cost_model(s, s * s, 2e-6 * s + 3e-10 * s * s)
    assert a2 == pytest.approx(2e-6) and b2 == pytest.approx(3e-10) and r2 == pytest.approx(1.0)
    with pytest.raises(ValueError):
        bp.fit_cost_model(s[:1], s[:1], s[:1])


needs_cli = pytest.mark.skipif(not CLI or not os.path.exists(CLI),
                               reason="BRAGG_PACK_CLI not set (run through ctest)")


@needs_cli
def test_cli_plan_json_contract(tmp_path):
    f = tmp_path / "lengths.txt"
    f.write_text("\n".join(str(x) for x in [1, 7, 100, 33, 4000, 12, 65, 900]) + "\n")
    out = subprocess.run([CLI, "plan", "--lengths", str(f), "--dp", "2", "--max-tokens", "8192",
                          "--cp", "2", "--tp", "2", "--sp", "--fp8", "--cost-a", "1",
                          "--cost-b", "0.001", "--json"], check=True, capture_output=True,
                         text=True).stdout
    j = json.loads(out)
    s = j["summary"]
    for key in ("traces", "ranks", "micro_batches_per_rank", "max_over_mean", "lower_bound",
                "padding_fraction", "plan_ms"):
        assert key in s
    assert s["traces"] == 8 and s["ranks"] == 2
    ids = []
    for rank in j["ranks"]:
        assert len(rank["micro_batches"]) == s["micro_batches_per_rank"]
        for mb in rank["micro_batches"]:
            assert len(mb["cu_seqlens"]) == len(mb["trace_ids"]) + 1
            assert all(d % 16 == 0 for d in np.diff(mb["cu_seqlens_padded"]))
            ids += mb["trace_ids"]
    assert sorted(ids) == list(range(8))
    text = subprocess.run([CLI, "plan", "--lengths", str(f), "--dp", "2", "--micro-batches", "1"],
                          check=True, capture_output=True, text=True).stdout
    assert "max/mean" in text
    row = json.loads(subprocess.run(
        [CLI, "plan", "--lengths", str(f), "--dp", "2", "--micro-batches", "1", "--fp8",
         "--fp8-align", "row", "--json"], check=True, capture_output=True, text=True).stdout)
    assert row["summary"]["fp8_align"] == "row" and row["summary"]["row_alignment"] == 16
    for rank in row["ranks"]:
        for mb in rank["micro_batches"]:
            assert mb["cu_seqlens_padded"][-1] % 16 == 0
            assert all(d >= 0 for d in np.diff(mb["cu_seqlens_padded"]) - np.diff(mb["cu_seqlens"]))
    bad = subprocess.run([CLI, "plan", "--lengths", str(f), "--dp", "2", "--micro-batches", "1",
                          "--fp8", "--fp8-align", "rows"], capture_output=True, text=True)
    assert bad.returncode != 0 and "trace or row" in bad.stderr
    bad = subprocess.run([CLI, "plan", "--lengths", str(f), "--dp", "2", "--micro-batches", "1",
                          "--fp8-align", "row"], capture_output=True, text=True)
    assert bad.returncode != 0 and "needs --fp8" in bad.stderr


@needs_cli
def test_cli_cp_indices_and_errors(tmp_path):
    out = subprocess.run([CLI, "cp-indices", "--cu-seqlens-padded", "0,8,20", "--cp", "2",
                          "--rank", "0"], check=True, capture_output=True, text=True).stdout
    assert out.strip() == "0,1,6,7,8,9,10,17,18,19"
    bad = subprocess.run([CLI, "cp-indices", "--cu-seqlens-padded", "0,8,18", "--cp", "2",
                          "--rank", "0"], capture_output=True, text=True)
    assert bad.returncode != 0 and "multiple of 2*cp" in bad.stderr
    f = tmp_path / "bad.txt"
    f.write_text("12\nabc\n")
    r = subprocess.run([CLI, "plan", "--lengths", str(f), "--dp", "1", "--micro-batches", "1"],
                       capture_output=True, text=True)
    assert r.returncode != 0 and "line 2" in r.stderr
    r = subprocess.run([CLI, "plan", "--lengths", str(tmp_path / "missing"), "--dp", "1",
                        "--micro-batches", "1"], capture_output=True, text=True)
    assert r.returncode != 0
    r = subprocess.run([CLI, "plan", "--lengths", str(f), "--dp", "1", "--micro-batches", "1",
                        "--max-tokens", "5"], capture_output=True, text=True)
    assert r.returncode != 0
