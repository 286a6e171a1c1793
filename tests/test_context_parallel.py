"""torch_kda.distributed.context_parallel_kda: W processes joined by gloo on the CPU
(spawned by the test, bounded in time), each with its slice of every sequence,
against one process's torch_kda.kda on the whole sequences in float64: out, the
final state and every gradient within 1e-10; where two GPUs are present, two
processes joined by NCCL, one GPU each, within bf16's rounding. Slices of unequal length,
an empty one, both gates, with and without an initial state, grouped value heads,
packed sequences crossing 0, 1 and 2 rank boundaries, and the one-process unfold
of the backward checked against autograd."""
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import torch_kda
from conftest import make_inputs, positional, rel
from torch_kda import distributed as cp

F64 = torch.float64
NAMES = ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state")
TOKEN_INPUTS = ("q", "k", "v", "g", "beta")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_main(rank, world, port, case_path, result_path, backend="gloo"):
    """One rank: its slices of the case's inputs (on GPU `rank` with nccl), forward and
    backward through context_parallel_kda, its results saved to the CPU."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        dist.init_process_group(backend, rank=rank, world_size=world, device_id=device)
    else:
        dist.init_process_group(backend, rank=rank, world_size=world)
    try:
        case = torch.load(case_path)
        d = {n: (t.to(device) if t is not None else None) for n, t in case["inputs"].items()}
        case = {n: (t.to(device) if isinstance(t, torch.Tensor) else t) for n, t in case.items()}
        cuts = case["cuts"]
        s, e = cuts[rank], cuts[rank + 1]
        x = {n: d[n][:, s:e].clone().requires_grad_(True) for n in TOKEN_INPUTS}
        for n in ("A_log", "dt_bias"):
            x[n] = d[n].clone().requires_grad_(True) if d[n] is not None else None
        init = d["initial_state"].clone().requires_grad_(True) if d["initial_state"] is not None and rank == 0 else None
        out, final = cp.context_parallel_kda(*(x[n] for n in NAMES[:7]), lower_bound=case["lower_bound"],
                                             initial_state=init, output_final_state=True,
                                             cu_seqlens=d["cu_seqlens"])
        loss = (out * case["w_out"][:, s:e]).sum()
        if final is not None:
            loss = loss + (final * case["w_final"]).sum()
        loss.backward()
        grads = {n: (x[n].grad if x.get(n) is not None else None) for n in NAMES[:7]}
        grads["initial_state"] = init.grad if init is not None else None
        cpu = lambda t: None if t is None else t.detach().cpu()  # noqa: E731
        torch.save(dict(out=cpu(out), final=cpu(final), grads={n: cpu(t) for n, t in grads.items()}),
                   f"{result_path}.{rank}")
    finally:
        dist.destroy_process_group()


CASES = {
    # name: (world, slice lengths, make_inputs kwargs, lower_bound, with an initial state)
    "two_softplus_state": (2, [9, 14], dict(B=2, H=2), None, True),
    "three_bounded": (3, [5, 11, 3], dict(B=1, H=2), -2.0, False),
    "four_empty_slice_grouped": (4, [7, 0, 12, 4], dict(B=2, H=1, HV=2), None, True),
    # packed sequences of 3, 0, 20, 2 and 4 tokens: the 20-token one crosses two rank
    # boundaries, the others none
    "varlen_three": (3, [8, 6, 15], dict(seqlens=[3, 0, 20, 2, 4], H=2), -1.0, True),
    "varlen_two_no_state": (2, [10, 19], dict(seqlens=[12, 17], H=2), None, False),
    # bf16 inputs and fp32 states: within the precision rules, not to the bit
    "two_bf16": (2, [17, 15], dict(B=1, H=2, dtype=torch.bfloat16, state_dtype=torch.float32), -5.0, True),
}


@pytest.mark.parametrize("name", list(CASES))
def test_ranks_equal_one_process(name, tmp_path):
    world, lengths, shape, lower_bound, with_state = CASES[name]
    kw = dict(K=4, V=3, dtype=F64, state_dtype=F64 if with_state else None)
    kw.update(shape)
    check_ranks_against_one_process(world, lengths, kw, lower_bound, with_state, tmp_path)


NCCL_CASES = {
    # name: (slice lengths, make_inputs kwargs, lower_bound)
    "bounded": ([300, 212], dict(B=1, H=2), -5.0),
    "softplus_varlen": ([250, 262], dict(seqlens=[100, 0, 340, 72], H=2), None),
}


@pytest.mark.cuda
@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.device_count() >= 2 and torch_kda.cuda_built()),
                    reason="needs two CUDA GPUs and a CUDA build")
@pytest.mark.parametrize("name", list(NCCL_CASES))
def test_two_gpus_over_nccl_equal_one_gpu(name, tmp_path):
    """The real thing: two processes, one GPU each, NCCL; bf16 inputs, K = V = 128,
    fp32 states, against one process's torch_kda.kda on the whole sequences (GPU)."""
    lengths, shape, lower_bound = NCCL_CASES[name]
    kw = dict(K=128, V=128, dtype=torch.bfloat16, state_dtype=torch.float32, **shape)
    check_ranks_against_one_process(2, lengths, kw, lower_bound, True, tmp_path, backend="nccl")


def check_ranks_against_one_process(world, lengths, kw, lower_bound, with_state, tmp_path, backend="gloo"):
    """`world` processes, rank r the r-th slice of `lengths` tokens, against one
    process on the whole sequences (on GPU 0 with nccl): out, the final state, every
    gradient (A_log's and dt_bias's summed over the ranks); to 1e-10 in float64, within
    bf16's rounding otherwise."""
    kw = dict(kw)
    if "seqlens" not in kw:
        kw["T"] = sum(lengths)
    d = make_inputs(**kw)
    tol, grad_tol = (5e-3, 1e-2) if kw["dtype"] == torch.bfloat16 else (1e-10, 1e-10)
    dev = torch.device("cuda", 0) if backend == "nccl" else torch.device("cpu")
    cuts = [0]
    for n in lengths:
        cuts.append(cuts[-1] + n)
    ref = {n: (t.detach().clone().to(dev).requires_grad_(True) if t is not None else None)
           for n, t in d.items() if n in NAMES}
    cu = d["cu_seqlens"].to(dev) if d["cu_seqlens"] is not None else None
    out, final = torch_kda.kda(*(ref[n] for n in NAMES[:7]), lower_bound=lower_bound,
                               initial_state=ref["initial_state"], output_final_state=True, cu_seqlens=cu)
    w_out, w_final = torch.randn_like(out), torch.randn_like(final)
    ((out * w_out).sum() + (final * w_final).sum()).backward()
    out, final = out.detach().cpu(), final.detach().cpu()
    ref_grads = {n: (t.grad.cpu() if t is not None else None) for n, t in ref.items()}

    case_path, result_path = str(tmp_path / "case.pt"), str(tmp_path / "result")
    torch.save(dict(inputs=d, cuts=cuts, lower_bound=lower_bound, w_out=w_out.cpu(), w_final=w_final.cpu()),
               case_path)
    mp.start_processes(rank_main, args=(world, free_port(), case_path, result_path, backend), nprocs=world,
                       start_method="spawn", join=True)
    res = [torch.load(f"{result_path}.{r}") for r in range(world)]

    assert rel(torch.cat([r["out"] for r in res], 1), out) <= tol
    assert all(r["final"] is None for r in res[:-1])
    assert rel(res[-1]["final"], final) <= tol
    for n in TOKEN_INPUTS:
        assert rel(torch.cat([r["grads"][n] for r in res], 1), ref_grads[n]) <= grad_tol, n
    for n in ("A_log", "dt_bias"):  # each rank's part; their sum is the whole gradient
        assert rel(sum(r["grads"][n] for r in res), ref_grads[n]) <= grad_tol, n
    if with_state:
        assert rel(res[0]["grads"]["initial_state"], ref_grads["initial_state"]) <= grad_tol


def test_fold_and_unfold_in_one_process():
    """The steps between the collectives, without a process group: the fold of three
    slices' maps gives each slice's true start state, and the unfold gives each
    slice's end-state gradient as autograd does through the fold."""
    d = make_inputs(B=1, T=24, H=2, K=4, V=3, dtype=F64, state_dtype=F64)
    cuts = [0, 7, 15, 24]
    maps = [cp._maps(*(d[n][:, cuts[r]:cuts[r + 1]] if n in TOKEN_INPUTS else d[n] for n in NAMES[:7]), None, None,
                     d["initial_state"] if r == 0 else None) for r in range(3)]
    A = torch.stack([m[0] for m in maps]).requires_grad_(True)
    B = torch.stack([m[1] for m in maps]).requires_grad_(True)
    starts = cp._fold(A, B)
    for r in range(1, 3):
        prefix = {n: d[n][:, :cuts[r]] for n in TOKEN_INPUTS}
        _, want = torch_kda.kda(*(prefix.get(n, d[n]) for n in NAMES[:7]), initial_state=d["initial_state"],
                                output_final_state=True)
        assert rel(starts[r], want) <= 1e-12, r
    # Unfold: with C the gradient reaching each start from elsewhere, the end gradients.
    C = torch.randn_like(B)
    g_final = torch.randn_like(B[0])
    end = starts[-1] @ A[-1] + B[-1]
    loss = (end * g_final).sum() + sum((starts[r] * C[r]).sum() for r in range(1, 3))
    dB = torch.autograd.grad(loss, B)[0]  # dL/dB_r = dL/dX_end_r
    assert rel(cp._unfold_grads(A.detach(), C, g_final), dB) <= 1e-12


def test_initial_state_off_rank_zero_is_refused(monkeypatch):
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    d = make_inputs(B=1, T=4, H=1, K=4, V=3, dtype=F64, state_dtype=F64)
    with pytest.raises(ValueError, match="initial_state enters on rank 0 only, got one on rank 1"):
        cp.context_parallel_kda(*positional(d), group=object(), initial_state=d["initial_state"])


@pytest.mark.cuda
@pytest.mark.skipif(not (torch.cuda.is_available() and torch_kda.cuda_built()), reason="needs a CUDA GPU and build")
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=["fp32_state", "bf16_state"])
@pytest.mark.parametrize("lower_bound", [-5.0, None], ids=["bounded", "softplus"])
def test_ranks_local_steps_on_one_gpu(lower_bound, state_dtype):
    """Three ranks' local steps in one process on the GPU (bf16 inputs, K = V = 128):
    each slice's start state from the fold equals the state the whole prefix reaches,
    and each slice's out from that start equals the whole call's out on that slice,
    within the state dtype's precision (fp32: 1e-4 and bf16 rounding of out; bf16: the
    two calls' 5e-3 budgets each)."""
    state_tol, out_tol = (1e-4, 5e-3) if state_dtype == torch.float32 else (1e-2, 1e-2)
    d = make_inputs(B=1, T=600, H=2, K=128, V=128, dtype=torch.bfloat16, state_dtype=state_dtype)
    d = {n: (t.cuda() if t is not None else None) for n, t in d.items()}
    cuts = [0, 190, 411, 600]
    whole, _ = torch_kda.kda(*(d[n] for n in NAMES[:7]), lower_bound=lower_bound, initial_state=d["initial_state"])
    maps = [cp._maps(*(d[n][:, cuts[r]:cuts[r + 1]] if n in TOKEN_INPUTS else d[n] for n in NAMES[:7]), None,
                     lower_bound, d["initial_state"] if r == 0 else None) for r in range(3)]
    starts = cp._fold(torch.stack([m[0] for m in maps]), torch.stack([m[1] for m in maps]))
    for r in (1, 2):
        prefix = {n: d[n][:, :cuts[r]] for n in TOKEN_INPUTS}
        _, want = torch_kda.kda(*(prefix.get(n, d[n]) for n in NAMES[:7]), lower_bound=lower_bound,
                                initial_state=d["initial_state"], output_final_state=True)
        assert rel(starts[r], want) <= state_tol, r
        part = {n: d[n][:, cuts[r]:cuts[r + 1]] for n in TOKEN_INPUTS}
        out, _ = torch_kda.kda(*(part.get(n, d[n]) for n in NAMES[:7]), lower_bound=lower_bound,
                               initial_state=starts[r].to(state_dtype))
        assert rel(out, whole[:, cuts[r]:cuts[r + 1]]) <= out_tol, r


def layer_rank_main(rank, world, port, case_path, result_path):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from torch_kda.nn import KimiDeltaAttention

        case = torch.load(case_path)
        layer = KimiDeltaAttention(*case["args"], **case["kwargs"]).double()
        layer.load_state_dict(case["params"])
        s, e = case["cuts"][rank], case["cuts"][rank + 1]
        x = case["x"][:, s:e].clone().requires_grad_(True)
        y, _ = layer(x, cu_seqlens=case["cu"], cp_group=dist.group.WORLD)
        (y * case["w"][:, s:e]).sum().backward()
        torch.save(dict(y=y.detach(), dx=x.grad, grads={n: p.grad for n, p in layer.named_parameters()}),
                   f"{result_path}.{rank}")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world, lengths, seqlens", [
    (2, [6, 9], None),
    (3, [5, 2, 8], None),
    (3, [7, 2, 12], [4, 0, 9, 1, 7]),  # packed: the 9-token sequence crosses two boundaries
], ids=["two", "three_short_slice", "three_packed"])
def test_layer_under_context_parallelism_equals_the_whole(world, lengths, seqlens, tmp_path):
    """KimiDeltaAttention with cp_group: each rank's slice of y and of x's gradient, and
    the parameter gradients summed over ranks, equal the layer on the whole sequences
    (a slice shorter than the convolution's width included: its halo reaches two ranks
    back; packed sequences whose halo crosses ranks and starts mid-slice)."""
    from torch_kda.nn import KimiDeltaAttention

    args, kwargs = (16, 2, 4), dict(conv_size=4, lower_bound=None, num_v_heads=4)
    layer = KimiDeltaAttention(*args, **kwargs).double()
    with torch.no_grad():
        layer.A_log.uniform_(-2.0, 0.0)
        layer.o_norm.weight.uniform_(0.5, 1.5)
    cu = None if seqlens is None else torch.tensor([0] + seqlens).cumsum(0)
    x = torch.randn(2 if seqlens is None else 1, sum(lengths), 16, dtype=F64, requires_grad=True)
    y, _ = layer(x, cu_seqlens=cu)
    w = torch.randn_like(y)
    (y * w).sum().backward()
    cuts = [0]
    for n in lengths:
        cuts.append(cuts[-1] + n)
    case_path, result_path = str(tmp_path / "case.pt"), str(tmp_path / "result")
    torch.save(dict(args=args, kwargs=kwargs, params=layer.state_dict(), x=x.detach(), w=w, cuts=cuts, cu=cu),
               case_path)
    mp.start_processes(layer_rank_main, args=(world, free_port(), case_path, result_path), nprocs=world,
                       start_method="spawn", join=True)
    res = [torch.load(f"{result_path}.{r}") for r in range(world)]
    assert rel(torch.cat([r["y"] for r in res], 1), y) <= 1e-10
    assert rel(torch.cat([r["dx"] for r in res], 1), x.grad) <= 1e-10
    for n, p in layer.named_parameters():
        assert rel(sum(r["grads"][n] for r in res), p.grad) <= 1e-10, n


def test_layer_cp_group_refuses_what_it_does_not_serve():
    from torch_kda.nn import KimiDeltaAttention

    layer = KimiDeltaAttention(16, 2, 4)
    with pytest.raises(ValueError, match="with cp_group each rank passes its slice of the tokens; state and "
                                         "output_state are not served with it"):
        layer(torch.randn(1, 4, 16), output_state=True, cp_group=object())
