"""Issue 30: the main job on fewer GPUs than processes, srun's per-task GPUs, the speed knobs, MFU.

Device counts and launcher variables are faked (``torch.cuda`` functions monkeypatched, environments
passed in), as the launcher tests of ``test_state.py`` and ``test_run.py`` do; nothing here needs a GPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from helpers import PYTHONPATH, REPO

from xffl_like.bench.mfu import FORMULA, flops_per_token, measure, peak_flops
from xffl_like.config.validate import ConfigError, validate_config
from xffl_like.data.synthetic import BRANCH, SyntheticMarkovSource
from xffl_like.distributed.device import choose_backend, gpus_bound_per_task
from xffl_like.job import _compose, choices, configured_backend, device_notice, resolve, typed_config
from xffl_like.models import LlamaConfig, build_model, count_parameters
from xffl_like.models.llama import Attention, rope_cos_sin
from xffl_like.train.speed import compile_blocks, compiles, compute_dtype, fused_adamw

SRUN_PER_TASK = {"SLURM_PROCID": "2", "SLURM_NTASKS": "4", "SLURM_LOCALID": "2", "SLURM_NTASKS_PER_NODE": "4"}


def fake_gpus(monkeypatch, count: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


def main_job(*overrides: str):
    composed = _compose(["+experiment=llama_fed", *overrides])
    return typed_config(resolve(composed), choices(composed))


# ----------------------------------------------------------------------------- item 1: device and backend
@pytest.mark.parametrize(
    "requested, local, gpus, bound, backend, device, notice",
    [
        ("auto", 4, 4, False, "nccl", "cuda", False),  # one GPU per rank
        ("auto", 4, 8, False, "nccl", "cuda", False),
        ("auto", 4, 0, False, "gloo", "cpu", False),  # a CPU machine: as before, silently
        ("auto", 4, 1, False, "gloo", "cpu", True),  # the README's main job on one GPU
        ("auto", 4, 2, False, "gloo", "cpu", True),  # fewer GPUs than local ranks
        ("auto", 4, 1, True, "nccl", "cuda", False),  # srun --gpus-per-task=1: each task its own GPU
        ("nccl", 4, 1, True, "nccl", "cuda", False),
        ("nccl", 2, 2, False, "nccl", "cuda", False),
        ("gloo", 4, 4, False, "gloo", "cpu", False),
    ],
)
def test_the_backend_and_device_chosen(requested, local, gpus, bound, backend, device, notice):
    choice = choose_backend(requested, local, gpus=gpus, bound=bound)
    assert (choice.backend, choice.device_type) == (backend, device)
    assert (choice.notice is not None) == notice
    if notice:  # one line: what was chosen and how to change it
        assert "\n" not in choice.notice and choice.notice.startswith("notice: ")
        assert "running on the CPU over gloo" in choice.notice
        assert f"distributed.nproc_per_node={gpus}" in choice.notice and "distributed.backend=gloo" in choice.notice


@pytest.mark.parametrize(
    "requested, local, gpus, needle",
    [
        ("nccl", 4, 0, "distributed.backend=nccl needs CUDA GPUs, and torch sees none"),
        ("nccl", 4, 1, "distributed.backend=nccl needs one GPU per process: 4 processes on this node, 1 GPU(s)"),
        ("nccl", 4, 3, "lower distributed.nproc_per_node to 3"),
        ("mpi", 1, 0, "distributed.backend='mpi': use auto, gloo or nccl"),
    ],
)
def test_a_job_that_cannot_run_is_refused_in_one_line(requested, local, gpus, needle):
    with pytest.raises(ConfigError) as err:
        choose_backend(requested, local, gpus=gpus, bound=False)
    assert needle in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize(
    "env, bound",
    [
        ({**SRUN_PER_TASK, "SLURM_GPUS_PER_TASK": "1"}, True),
        ({**SRUN_PER_TASK, "SLURM_GPUS_PER_TASK": "h100:1"}, True),
        ({**SRUN_PER_TASK, "SLURM_TRES_PER_TASK": "cpu=8,gres/gpu:1"}, True),  # Slurm 23.11+
        ({**SRUN_PER_TASK, "SLURM_TRES_PER_TASK": "cpu=8"}, False),
        ({**SRUN_PER_TASK, "SLURM_GPUS_PER_TASK": "0"}, False),
        (SRUN_PER_TASK, False),  # srun without a GPU binding: the tasks share what they see
        ({"SLURM_GPUS_PER_TASK": "1"}, False),  # a batch script's variables, not an srun task
        ({**SRUN_PER_TASK, "SLURM_GPUS_PER_TASK": "1", "RANK": "0"}, False),  # workers launched by the job
    ],
)
def test_srun_binding_a_gpu_to_each_task(env, bound):
    assert gpus_bound_per_task(env) is bound


def test_the_main_job_validates_on_one_gpu(monkeypatch, capsys):
    """auto: validated, and the notice (one line, stderr) says the CPU was chosen; nccl: refused in one line."""
    fake_gpus(monkeypatch, 1)
    job, layout = validate_config(main_job(), 4, 4, REPO)
    assert layout.world_size == 4
    device_notice(job, 4)
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("notice: 4 processes on this node but 1 GPU(s)"), err
    with pytest.raises(ConfigError, match="needs one GPU per process: 4 processes on this node, 1 GPU"):
        validate_config(main_job("distributed.backend=nccl"), 4, 4, REPO)


def test_nccl_under_srun_with_one_gpu_per_task_is_accepted(monkeypatch):
    """srun --gpus-per-task=1 -n 4: each task sees one GPU; SLURM_NTASKS_PER_NODE=4 is no reason to refuse."""
    fake_gpus(monkeypatch, 1)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    for key, value in {**SRUN_PER_TASK, "SLURM_GPUS_PER_TASK": "1"}.items():
        monkeypatch.setenv(key, value)
    validate_config(main_job("distributed.backend=nccl"), 4, 4, REPO)  # no error
    assert configured_backend(["+experiment=llama_fed", "distributed.backend=nccl"], 4) == "nccl"
    monkeypatch.delenv("SLURM_GPUS_PER_TASK")  # no binding: four tasks on one GPU
    with pytest.raises(ConfigError, match="needs one GPU per process"):
        validate_config(main_job("distributed.backend=nccl"), 4, 4, REPO)


def test_each_rank_initialises_the_chosen_backend(monkeypatch):
    """Under torchrun/srun the default group is made before the config is validated: with 4 ranks on a
    one-GPU node, auto is gloo there too (it was nccl, with every rank on cuda:0)."""
    import torch.distributed as dist

    from xffl_like.distributed.env import ProcessEnv
    from xffl_like.distributed.state import init_default_group

    fake_gpus(monkeypatch, 1)
    assert configured_backend(["+experiment=llama_fed"], 4) == "gloo"
    assert configured_backend(["+experiment=llama_fed", "distributed.backend=nccl"], 4) == "gloo"  # rank 0 refuses
    assert configured_backend(["+experiment=llama_fed", "distributed.nproc_per_node=1"], 1) == "nccl"
    made = []

    def init_process_group(backend=None, device_id=None, **kwargs):
        made.append((backend, device_id))

    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    device = init_default_group(ProcessEnv(3, 4, 3, 4), "auto")  # no MASTER_ADDR: no store is made
    assert device == torch.device("cpu") and made == [("gloo", None)]


def test_the_main_job_on_a_faked_one_gpu_launcher(tmp_path):
    """The launcher believes it has one GPU (its workers, started afresh, see this machine's none): the job
    runs on the CPU after one notice line, and summary.json records the device and every group's backend."""
    script = (
        "import sys, torch\n"
        "torch.cuda.is_available = lambda: True\n"
        "torch.cuda.device_count = lambda: 1\n"
        "from xffl_like.run import cli\n"
        "sys.argv = ['xffl_like.run', *sys.argv[1:]]\n"
        "cli()\n"
    )
    env = {**os.environ, "PYTHONPATH": PYTHONPATH, "WANDB_MODE": "offline"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS"):
        env.pop(key, None)
    args = ["+experiment=llama_fed", "logger=none", "distributed.nproc_per_node=2", "train.steps=2",
            "federation.every=1", "optim.warmup_steps=1", "train.seq_len=16", "train.batch_size=2",
            f"hydra.run.dir={tmp_path}"]  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-c", script, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    notices = [line for line in proc.stderr.splitlines() if line.startswith("notice:")]
    assert len(notices) == 1 and "2 processes on this node but 1 GPU(s)" in notices[0], proc.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["device"] == "cpu"
    assert summary["group_backends"]["world"] == "gloo" and summary["group_backends"]["background"] == "gloo"
    assert set(summary["group_backends"]) >= {"world", "facility", "replica", "shard", "peers", "background"}


# ----------------------------------------------------------------------------- item 3: speed knobs
def test_dtype_and_compile_auto_follow_the_device():
    assert compute_dtype("auto", torch.device("cuda", 0)) == "bfloat16"
    assert compute_dtype("auto", torch.device("cpu")) == "float32"
    assert compute_dtype("float32", torch.device("cuda", 0)) == "float32"
    assert compute_dtype("bfloat16", torch.device("cpu")) == "bfloat16"
    assert compiles("auto", torch.device("cuda", 0)) and not compiles("auto", torch.device("cpu"))
    assert compiles(True, torch.device("cpu")) and not compiles(False, torch.device("cuda", 0))


@pytest.mark.parametrize(
    "override, needle",
    [
        ("train.compile=maybe", "train.compile='maybe': use one of auto, true, false"),
        ("train.compile=1", "train.compile=1: use one of auto, true, false"),
        ("train.dtype=float16", "train.dtype='float16': use one of auto, float32, bfloat16"),
    ],
)
def test_bad_speed_knobs_are_one_line(override, needle):
    with pytest.raises(ConfigError) as err:
        validate_config(main_job(override), 4, 4, REPO)
    assert needle in str(err.value)


def test_speed_knob_defaults_and_decentralized_auto():
    job = main_job()
    assert job.train.dtype == "auto" and job.train.compile == "auto"
    validate_config(main_job("train.compile=true", "train.dtype=float32"), 4, 4, REPO)
    validate_config(main_job("parallel=decentralized", "distributed.federated=null"), 4, 4, REPO)  # auto: fp32


def test_fused_adamw_only_off_the_cpu():
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    from xffl_like.config.schema import OptimConfig
    from xffl_like.train.optim import build_optimizer

    assert "cuda" in _get_fused_kernels_supported_devices()
    assert not fused_adamw([torch.zeros(2), torch.zeros(3)])  # the CPU keeps foreach: its figures unchanged
    assert not fused_adamw([torch.zeros(2, device="meta")])
    model = torch.nn.Linear(2, 2)
    opt = build_optimizer(model, OptimConfig.from_mapping({"name": "adamw", "lr": 1e-3}))
    assert not opt.defaults["fused"]


@pytest.mark.parametrize("n_heads, n_kv_heads", [(4, 2), (8, 2), (4, 4)])
def test_gqa_attention_equals_repeated_kv_heads(n_heads, n_kv_heads):
    """enable_gqa SDPA: the output of K/V heads repeated explicitly (the former code), forward and backward."""
    cfg = LlamaConfig(
        dim=64, n_layers=1, n_heads=n_heads, n_kv_heads=n_kv_heads, vocab_size=32, ffn_dim=96, max_seq_len=16
    )
    torch.manual_seed(0)
    attn = Attention(cfg)
    x = torch.randn(2, 16, 64, requires_grad=True)
    cos, sin = rope_cos_sin(cfg)
    cos, sin = cos[:16], sin[:16]
    y = attn(x, cos, sin)

    def reference(x):
        from xffl_like.models.llama import apply_rope

        B, T, _ = x.shape
        hd, rep = cfg.head_dim, n_heads // n_kv_heads
        q = attn.wq(x).view(B, T, n_heads, hd)
        k = attn.wk(x).view(B, T, n_kv_heads, hd)
        v = attn.wv(x).view(B, T, n_kv_heads, hd)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return attn.wo(out.transpose(1, 2).reshape(B, T, -1))

    ref = reference(x)
    torch.testing.assert_close(y, ref, rtol=0, atol=1e-6)
    grads = torch.autograd.grad(y.square().sum(), [x, attn.wk.weight, attn.wv.weight])
    ref_grads = torch.autograd.grad(ref.square().sum(), [x, attn.wk.weight, attn.wv.weight])
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_compiled_blocks_keep_names_and_values():
    cfg = LlamaConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=40, ffn_dim=48, max_seq_len=16)
    model = build_model(cfg, seed=0)
    tokens = torch.randint(0, 40, (2, 16))
    eager = model(tokens)
    names = [n for n, _ in model.named_parameters()]
    torch.compiler.reset()
    assert compile_blocks(model, backend="eager") == 2
    assert [n for n, _ in model.named_parameters()] == names  # checkpoints and exports keep their keys
    assert all(hasattr(block.forward, "_torchdynamo_orig_callable") for block in model.layers)
    torch.testing.assert_close(model(tokens), eager, rtol=0, atol=0)


def _old_sample(source, gen, batch_size, length):
    """The source's former sampler, a Python loop over the positions (reproduced here, unchanged)."""
    v, k = source.vocab_size, BRANCH
    cur = torch.multinomial(source._start_prior, batch_size, replacement=True, generator=gen)
    use_fac = torch.rand(batch_size, length - 1, generator=gen) < source.non_iid
    row_off = use_fac.to(torch.long) * v
    u = torch.rand(batch_size, length - 1, 1, generator=gen)
    out = torch.empty(batch_size, length, dtype=torch.long)
    out[:, 0] = cur
    cum, succ = source._cum, source._succ_flat
    for t in range(length - 1):
        row = cur + row_off[:, t]
        slot = (u[:, t] >= cum.index_select(0, row)).sum(dim=1)
        cur = succ.index_select(0, row * k + slot)
        out[:, t + 1] = cur
    return out


def test_compiled_loss_equals_plain_cross_entropy_with_gradients():
    """train.compile compiles one chunk's loss (norm, head, fp32 cross-entropy) as well as the blocks: the
    chunked, checkpointed, compiled loss (aot_eager here: the same AOT graphs inductor would fuse) equals plain
    F.cross_entropy over the whole logits, gradients included."""
    cfg = LlamaConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=40, ffn_dim=48, max_seq_len=16)
    model = build_model(cfg, seed=0)
    tokens, targets = torch.randint(0, 40, (2, 16)), torch.randint(0, 40, (2, 16))
    ref = F.cross_entropy(model(tokens).flatten(0, 1).float(), targets.flatten())
    ref_grads = torch.autograd.grad(ref, list(model.parameters()))
    torch.compiler.reset()
    compile_blocks(model, backend="aot_eager")
    assert hasattr(model.chunk_loss, "_torchdynamo_orig_callable")
    loss = model(tokens, targets, loss_chunk=8)  # two chunks of 8 positions, each checkpointed
    grads = torch.autograd.grad(loss, list(model.parameters()))
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-6)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    with torch.no_grad():  # evaluation: no checkpoint, the same compiled function
        torch.testing.assert_close(model(tokens, targets, loss_chunk=8), ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "vocab, seq, batch, non_iid",
    [(256, 128, 8, 0.5), (16, 200, 2, 0.3), (300, 33, 3, 0.0), (20, 2, 1, 1.0), (128256, 64, 2, 0.5)],
)
def test_synthetic_batches_are_the_former_tokens(vocab, seq, batch, non_iid):
    from xffl_like.data.source import make_generator

    source = SyntheticMarkovSource(
        vocab_size=vocab, seq_len=seq, batch_size=batch, seed=7, facility=1, facility_rank=1, non_iid=non_iid,
        num_eval_batches=1,
    )  # fmt: skip
    for step in (0, 5):
        x, y = source.train_batch(step)
        gen = make_generator(7, 0x5452, 1, 1, step)  # the train stream's tags
        old = _old_sample(source, gen, batch, seq + 1)
        assert torch.equal(x, old[:, :-1]) and torch.equal(y, old[:, 1:])


def test_the_prefetcher_gives_the_sources_batches_one_ahead():
    from xffl_like.data.prefetch import Prefetcher

    class Source:
        def __init__(self):
            self.drawn = []

        def train_batch(self, step):
            self.drawn.append(step)
            return torch.full((2, 3), step), torch.full((2, 3), -step)

        def eval_batches(self):
            return ["eval"]

    source = Source()
    pre = Prefetcher(source, pin=torch.cuda.is_available())
    for step in (0, 1, 2, 7, 8):
        x, y = pre.train_batch(step)
        assert torch.equal(x, torch.full((2, 3), step)) and torch.equal(y, torch.full((2, 3), -step))
        assert x.is_pinned() == torch.cuda.is_available()
    pre.close()
    # 3 was drawn ahead before step 7 was asked for (and dropped); 9 perhaps, before close()
    assert {0, 1, 2, 3, 7, 8} <= set(source.drawn) <= {0, 1, 2, 3, 7, 8, 9}
    assert pre.eval_batches() == ["eval"]


# ----------------------------------------------------------------------------- item 6: MFU
def test_flops_formula_against_a_hand_count():
    """llama_tiny (dim 128, 4 layers, 4 heads, 2 kv heads, ffn 384, vocab 256, untied) at T = 128, by hand:
    per block wq 128*128 + wk 128*64 + wv 128*64 + wo 128*128 + w1..w3 3*128*384 + norms 2*128 = 196,864;
    N = 4 * 196,864 + final norm 128 + head 256*128 = 820,352; 6N = 4,922,112; attention 12*4*128*128 =
    786,432; 5,708,544 FLOPs per token."""
    tiny = LlamaConfig(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=256, ffn_dim=384, max_seq_len=256)
    per_token, n = flops_per_token(tiny, 128)
    assert n == 820_352 and per_token == 5_708_544
    assert n == count_parameters(build_model(tiny)) - 256 * 128  # all but the token embedding
    one_b = LlamaConfig(
        dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, vocab_size=128256, ffn_dim=8192, max_seq_len=8192,
        tie_embeddings=True,
    )  # fmt: skip
    per_token, n = flops_per_token(one_b, 2048)
    assert n == 1_235_814_400  # tied: the one matrix counted once, as the head's matmul
    assert n == count_parameters(build_model(one_b, device="meta"))
    assert per_token == 6 * 1_235_814_400 + 12 * 16 * 2048 * 2048
    assert "6*N + 12*L*d*T" in FORMULA


@pytest.mark.parametrize(
    "name, peak, sku",
    [
        ("NVIDIA H100 80GB HBM3", 989e12, "H100 SXM"),
        ("NVIDIA H100 PCIe", 756e12, "H100 PCIe"),
        ("NVIDIA H100 NVL", 835e12, "H100 NVL"),
        ("NVIDIA H200", 989e12, "H200 SXM"),
        ("NVIDIA H200 NVL", 835e12, "H200 NVL"),
        ("NVIDIA GH200 480GB", 989e12, "GH200"),
        ("NVIDIA A100-SXM4-80GB", 312e12, "A100"),
        ("NVIDIA A100 80GB PCIe", 312e12, "A100"),
        ("NVIDIA A10", 125e12, "A10"),
        ("NVIDIA L4", 121e12, "L4"),
        ("NVIDIA L40S", 362e12, "L40S"),
    ],
)
def test_the_peak_table(name, peak, sku, monkeypatch):
    monkeypatch.delenv("XFFL_PEAK_TFLOPS", raising=False)
    assert peak_flops(name) == (peak, sku)


def test_the_peak_override(monkeypatch):
    monkeypatch.delenv("XFFL_PEAK_TFLOPS", raising=False)
    assert peak_flops("Some Future GPU") is None
    assert peak_flops("NVIDIA H100 PCIe", override_tflops=500) == (500e12, "override")
    monkeypatch.setenv("XFFL_PEAK_TFLOPS", "700")
    assert peak_flops("NVIDIA H100 PCIe") == (700e12, "override")
    with pytest.raises(ValueError, match="must be a positive number"):
        peak_flops("x", override_tflops=0)


def test_throughput_times_steady_state_steps_on_cpu():
    """The measurement's own arithmetic: tokens/s over the timed steps only, MFU against the given peak."""
    m = measure("llama_tiny", 16, 2, dtype="float32", warmup=1, steps=2, peak_tflops=1.0)
    tiny = LlamaConfig(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=256, ffn_dim=384, max_seq_len=256)
    per_token, _ = flops_per_token(tiny, 16)
    assert m.timed_steps == 2 and m.device == "cpu" and m.dtype == "float32"
    assert m.tokens_per_second == pytest.approx(2 * 16 / m.step_seconds)
    assert m.mfu == pytest.approx(per_token * m.tokens_per_second / 1e12)
    assert m.peak_memory_bytes > 0
    assert "tokens/s, MFU" in m.line("llama_tiny", 16, 2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_throughput_on_cuda_reports_mfu():
    m = measure("llama_tiny", 64, 4, warmup=2, steps=3)
    assert m.dtype == "bfloat16" and (m.mfu is None or 0 < m.mfu < 1)


def test_async_staging_reuses_one_host_buffer_per_rank_across_saves():
    """The checkpointer's one stager copies each save into the host buffers of the last one (same place, shape and
    dtype): no allocation per save; a tensor whose shape changed gets a new buffer."""
    from xffl_like.checkpoint.staging import HostStager

    stager = HostStager()
    sd = {"model": {"w": torch.arange(6.0)}, "optim": [torch.ones(3)], "step": 3}
    first = stager.stage(sd)
    ptrs = (first["model"]["w"].data_ptr(), first["optim"][0].data_ptr())
    assert first["model"]["w"].data_ptr() != sd["model"]["w"].data_ptr() and first["step"] == 3
    sd["model"]["w"].add_(10)
    sd["optim"][0].mul_(5)
    second = stager.stage(sd)
    assert (second["model"]["w"].data_ptr(), second["optim"][0].data_ptr()) == ptrs
    assert torch.equal(second["model"]["w"], torch.arange(6.0) + 10)
    assert torch.equal(second["optim"][0], torch.full((3,), 5.0))
    sd["model"]["w"] = torch.zeros(7)
    third = stager.stage(sd)
    assert third["model"]["w"].shape == (7,) and third["optim"][0].data_ptr() == ptrs[1]
