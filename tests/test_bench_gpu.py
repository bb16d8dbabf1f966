"""The pure parts of ``python -m xffl_like.bench.gpu`` (issue 30 item 5): the predicates its checks assert."""

from xffl_like.bench import gpu as G


def test_a_job_that_fell_back_to_the_cpu_fails_a_gpu_check():
    assert G.ran_on_cuda({"device": "cuda:0", "group_backends": {"world": "cpu:gloo,cuda:nccl"}}) == (True, "")
    ok, why = G.ran_on_cuda({"device": "cpu", "group_backends": {"world": "gloo"}})
    assert not ok and "ran on cpu" in why and "gloo" in why
    assert not G.ran_on_cuda({"device": "cuda:0", "group_backends": {"world": "gloo"}})[0]
    assert not G.ran_on_cuda({})[0]  # an older summary without the fields


def test_streams2_must_equal_one_stream_bitwise():
    a = {"final_loss": 3.25, "facility_losses": [[4.0, 3.5], [4.1, 3.6]]}
    assert G.same_run(a, dict(a)) == (True, "bitwise equal losses")
    ok, figure = G.same_run(a, {**a, "final_loss": 3.25 + 2**-40})
    assert not ok and "final_loss" in figure
    assert not G.same_run(a, {**a, "facility_losses": [[4.0, 3.5], [4.1, 3.6000001]]})[0]
    assert not G.same_run({}, {})[0]  # nothing to compare is not a pass


def test_bf16_check_fails_when_bf16_is_ignored():
    assert G.bf16_took_effect(3.01, 3.0)[0]
    ok, figure = G.bf16_took_effect(3.0, 3.0)
    assert not ok and "bf16 was not used" in figure
    assert not G.bf16_took_effect(3.2, 3.0)[0]  # too far


def test_streams2_runs_a_one_stream_job_and_compares(monkeypatch, tmp_path):
    seen = []

    def fake_job(args, run_dir, timeout=900):
        seen.append(args)
        return {"final_loss": 2.0 if "strategy.streams=1" in args else 2.5, "facility_losses": [[2.0]]}

    monkeypatch.setattr(G, "job", fake_job)
    ok, figure = G._same_as_one_stream({"final_loss": 2.0, "facility_losses": [[2.0]]}, tmp_path)
    assert ok and figure == "vs one stream: bitwise equal losses"
    assert "strategy.streams=1" in seen[0] and "strategy.streams=2" not in seen[0]
    assert not G._same_as_one_stream({"final_loss": 2.5, "facility_losses": [[2.0]]}, tmp_path)[0]
