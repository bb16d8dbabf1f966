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
    low = {"final_loss": 3.01, "forward_param_dtype": "bfloat16"}
    full = {"final_loss": 3.0, "forward_param_dtype": "float32"}
    assert G.bf16_took_effect(low, full)[0]
    ok, figure = G.bf16_took_effect({**low, "forward_param_dtype": "float32"}, full)
    assert not ok and "bf16 was not used" in figure
    assert not G.bf16_took_effect({**low, "final_loss": 3.2}, full)[0]  # too far
    assert not G.bf16_took_effect({"final_loss": 3.01}, {"final_loss": 3.0})[0]  # an older summary: no dtype


def test_checkpoint_peak_must_stay_under_the_state_plus_ten_percent():
    state = 12 * 58_000_000
    ok, figure = G.checkpoint_peak_within([[state, int(1.05 * state)], [state, int(1.02 * state)]], state)
    assert ok and "1.050 x weights + optimizer state" in figure
    assert not G.checkpoint_peak_within([[state, int(1.05 * state)], [state, 2 * state]], state)[0]  # a device copy
    assert not G.checkpoint_peak_within([], state)[0]


def test_one_gpu_runs_at_least_eight_checks():
    """On one GPU at least 8 checks run (issue 30 item 5); the others say how many GPUs they need."""
    one = [name for name in G.CHECKS if G.gpus_needed(name) <= 1]
    assert len(one) >= 8, one
    assert {"bf16", "checkpoint", "hub", "hub_topk"} <= set(one)
    assert G.gpus_needed("hsdp") == 4 and G.gpus_needed("facilities") == 2
