#!/usr/bin/env python3
"""Train a tiny language model of KDA blocks on synthetic associative recall.

    python examples/train_tiny_lm.py                       # CPU, or the GPU if there is one
    python examples/train_tiny_lm.py --compile             # torch.compile(model, fullgraph=True)
    torchrun --standalone --nproc_per_node=2 examples/train_tiny_lm.py --fsdp   # FSDP2, 2 processes
    torchrun --standalone --nproc_per_node=2 examples/train_tiny_lm.py --cp 2   # context parallel
    torchrun --standalone --nproc_per_node=4 examples/train_tiny_lm.py --fsdp --cp 2   # FSDP2 x CP, 2 x 2

The model: token embedding, `--layers` blocks of
(RMSNorm -> torch_kda.nn.KimiDeltaAttention -> residual, RMSNorm -> SwiGLU MLP -> residual),
a final RMSNorm and a linear head.

The task (associative recall): each sequence lists P (key, value) token pairs with
distinct keys, then Q queries, each a key from the list followed by its value:

    k1 v1 k2 v2 ... kP vP  q1 a1 q2 a2 ... qQ aQ        (a_i is the value paired with q_i)

Keys are the tokens [0, vocab/2), values [vocab/2, vocab). The loss is the cross
entropy of predicting a_i at the position of q_i; every other position is ignored.
A model that does not look back at the pairs cannot beat ln(vocab/2), so the loss
going below that, and the recall accuracy going above chance (2/vocab), show that
the attention layers store and retrieve the pairs.

Batches come from a torch.Generator seeded with --seed, so a run is reproducible.
Every rank draws the same global batch of --batch-size sequences. With --fsdp each
data-parallel row (each rank without --cp) trains on its own slice of the sequences,
with --cp each rank of a row on its slice of their tokens: the global batch, and so
the loss curve, is the one a single process sees.

--fsdp: torch.distributed with gloo on CPU or nccl on CUDA, set up from the torchrun
environment variables (without them, a single-process group of world size 1 is
created). FSDP2 `fully_shard` takes each KimiDeltaAttention's projections (its
Linear children, one group) with MixedPrecisionPolicy(param_dtype=--dtype,
reduce_dtype=float32), then the layer itself, whose remaining parameters (A_log,
dt_bias, the convolutions' weights and the norm's) keep param_dtype=float32, so that
A_log and dt_bias reach the operator in fp32; then each block and the root with the
--dtype policy.

Before training, one forward pass records what the KDA operator receives (the
dtypes of q, k, v, g, beta, A_log, dt_bias) and checks that A_log and dt_bias are
fp32 and bit-for-bit equal to the fp32 master weights. The script stops with an
error if they are not.

The gate is the bounded one, lower_bound * sigmoid(exp(A_log) (g + dt_bias)) with
--lower-bound -5; --softplus-gate selects the softplus gate of Kimi-Linear.
Both run on the CPU and on CUDA.

Devices: on CPU the model runs in fp32 (with --fsdp, in --dtype). On CUDA the
operator needs head_dim 128 and bf16 q, k, v, g, beta, so there the head dim
defaults to 128 (--head-dim) and, without --fsdp, the model runs under bf16
autocast. The operator's CUDA backward is a first, slow version (ATen ops over
16-token chunks); builds from before it stop at the first backward with
NotImplementedError, which the script reports and re-raises.

--cp N: context parallelism over N torchrun ranks (gloo on CPU, nccl on CUDA): each
of them takes its slice of every sequence's tokens (torch_kda.distributed;
KimiDeltaAttention(..., cp_group=...)); the loss is the batch's mean, each rank's
part summed, and every parameter's gradient is summed over the N ranks, so the loss
curve is the one a single process sees. Without --fsdp N is the world size. With
--fsdp the ranks form a 2-D mesh (dp = world / N, cp = N): each dp row takes its
slice of the batch's sequences, FSDP2 shards the parameters over the cp ranks and
replicates them over dp (HSDP on the mesh), and the loss is scaled by N before the
backward so that FSDP2's mean over all ranks is the sum over cp and the mean over dp.

--compile wraps the model in torch.compile(model, fullgraph=True). With --fsdp or
--cp it drops fullgraph: FSDP2 keeps its hooks out of dynamo, and the context-parallel
collectives (torch.distributed.all_gather in autograd Functions) and the halo's
host-side offsets run eagerly, so the graph breaks at them.

--loss-file PATH writes the per-step losses, recall accuracies and step times (seconds,
wall clock; each step ends in a host read of its loss) as JSON, from rank 0.
"""
import argparse
import json
import math
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.utils._python_dispatch import TorchDispatchMode

from torch_kda.nn import KimiDeltaAttention

IGNORE_INDEX = -100


# --------------------------------------------------------------------------
# Data: associative recall.
# --------------------------------------------------------------------------


def recall_batch(gen, batch, seq_len, vocab, num_queries):
    """Returns (tokens [batch, seq_len], targets [batch, seq_len]) as int64 CPU tensors.

    targets[b, t] is the token that must follow tokens[b, t] where t is a query
    position, and IGNORE_INDEX everywhere else."""
    n_keys = vocab // 2
    n_values = vocab - n_keys
    pairs = seq_len // 2 - num_queries
    keys = torch.rand(batch, n_keys, generator=gen).argsort(dim=1)[:, :pairs]  # distinct keys
    values = n_keys + torch.randint(0, n_values, (batch, pairs), generator=gen)
    which = torch.rand(batch, pairs, generator=gen).argsort(dim=1)[:, :num_queries]  # distinct queries
    q_keys = keys.gather(1, which)
    q_values = values.gather(1, which)
    context = torch.stack([keys, values], dim=2).reshape(batch, 2 * pairs)
    queries = torch.stack([q_keys, q_values], dim=2).reshape(batch, 2 * num_queries)
    tokens = torch.cat([context, queries], dim=1)
    targets = torch.full_like(tokens, IGNORE_INDEX)
    targets[:, 2 * pairs :: 2] = q_values  # at each query key, predict its value
    return tokens, targets


# --------------------------------------------------------------------------
# Model.
# --------------------------------------------------------------------------


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32 whatever the parameter and input dtypes; returns x's dtype."""

    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        xf = x.float()
        y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.float()).to(x.dtype)


class SwiGLU(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.gate_up = nn.Linear(dim, 2 * hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, dim, num_heads, head_dim, lower_bound, mlp_ratio=4):
        super().__init__()
        self.attn_norm = RMSNorm(dim)
        self.attn = KimiDeltaAttention(dim, num_heads, head_dim, lower_bound=lower_bound)
        self.mlp_norm = RMSNorm(dim)
        self.mlp = SwiGLU(dim, mlp_ratio * dim)

    def forward(self, x, cp_group=None):
        y, _ = self.attn(self.attn_norm(x), cp_group=cp_group)
        x = x + y
        return x + self.mlp(self.mlp_norm(x))


class TinyLM(nn.Module):
    def __init__(self, vocab, dim, layers, num_heads, head_dim, lower_bound):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, num_heads, head_dim, lower_bound) for _ in range(layers))
        self.norm = RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens, cp_group=None):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, cp_group)
        return self.head(self.norm(x))


# --------------------------------------------------------------------------
# What the operator receives.
# --------------------------------------------------------------------------


class _RecordKDA(TorchDispatchMode):
    """Records the tensor arguments of every torch.ops.kda.fwd call below autograd."""

    NAMES = ("q", "k", "v", "g", "beta", "A_log", "dt_bias")

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.kda.fwd.default:
            self.calls.append({n: a.detach().clone() for n, a in zip(self.NAMES, args)})
        return func(*args, **(kwargs or {}))


def _full(p):
    """The full fp32 master value of a parameter (gathers it if FSDP sharded it)."""
    p = p.detach()
    return p.full_tensor() if hasattr(p, "full_tensor") else p


def gate_values(model):
    """[{"A_log": [...], "dt_bias": [...]}] per layer, the full fp32 values as Python floats."""
    layers = [m for m in model.modules() if isinstance(m, KimiDeltaAttention)]
    return [{n: _full(getattr(m, n)).float().flatten().tolist() for n in ("A_log", "dt_bias")} for m in layers]


def check_operator_inputs(model, tokens, autocast, expected_dtype, log, cp_group=None):
    """One forward pass without grad that records the KDA operator's inputs; checks
    that q, k, v, g, beta share `expected_dtype` and that A_log and dt_bias are fp32
    and equal, bit for bit, to the fp32 master parameters of each layer. Under
    context parallelism a layer calls the operator three times (its slice's two maps,
    then its outputs)."""
    recorder = _RecordKDA()
    with torch.no_grad(), autocast, recorder:
        model(tokens, cp_group) if cp_group is not None else model(tokens)
    gates = [m for m in model.modules() if isinstance(m, KimiDeltaAttention)]
    masters = [(_full(m.A_log), _full(m.dt_bias)) for m in gates]  # collective under FSDP: every rank runs it
    per_layer = 3 if cp_group is not None else 1
    if len(recorder.calls) != per_layer * len(gates):
        raise RuntimeError(f"expected {per_layer * len(gates)} calls of kda::fwd in one forward, "
                           f"saw {len(recorder.calls)}")
    problems = []
    for i, call in enumerate(recorder.calls):
        layer = i // per_layer
        A_log, dt_bias = masters[layer]
        for n in ("q", "k", "v", "g", "beta"):
            if call[n].dtype != expected_dtype:
                problems.append(f"layer {layer}: {n} is {call[n].dtype}, expected {expected_dtype}")
        for n, master in (("A_log", A_log), ("dt_bias", dt_bias)):
            if call[n].dtype != torch.float32:
                problems.append(f"layer {layer}: {n} is {call[n].dtype}, expected torch.float32")
            elif master.dtype != torch.float32 or not torch.equal(call[n].flatten(), master.flatten().to(call[n].device)):
                problems.append(f"layer {layer}: {n} differs from the fp32 master weights")
    if problems:
        raise RuntimeError("the KDA operator received wrong inputs:\n  " + "\n  ".join(problems))
    first = recorder.calls[0]
    qkv = ", ".join(f"{n} {str(first[n].dtype).replace('torch.', '')}" for n in ("q", "k", "v", "g", "beta"))
    log(
        f"kda op inputs: {qkv}; A_log float32, dt_bias float32 "
        f"(equal to the fp32 master weights in all {len(gates)} layers)"
    )


# --------------------------------------------------------------------------
# Distributed setup.
# --------------------------------------------------------------------------


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def setup_distributed(device_type, cp):
    """init_process_group from the torchrun environment (or as a world of 1 without
    it) and the device mesh: ("dp",) over all ranks, or ("dp", "cp") with cp ranks in
    a row when cp > 0. Returns (rank, world_size, device, mesh)."""
    from torch.distributed.device_mesh import init_device_mesh

    if "RANK" not in os.environ:  # not launched by torchrun: a world of one process
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    if cp:
        if world % cp:
            raise SystemExit(f"--cp {cp} must divide the world size {world}")
        mesh = init_device_mesh(device_type, (world // cp, cp), mesh_dim_names=("dp", "cp"))
    else:
        mesh = init_device_mesh(device_type, (world,), mesh_dim_names=("dp",))
    return rank, world, device, mesh


def shard_model(model, mesh, param_dtype):
    """FSDP2: each KDA layer's projections, then the layer (its small parameters kept in
    fp32), then each block, then the root."""
    # The layer's own unit computes nothing in fp32 that needs fp32 inputs: its inputs
    # stay in the compute dtype.
    fp32_policy = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32,
                                       cast_forward_inputs=False)
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for module in model.modules():
        if isinstance(module, KimiDeltaAttention):
            projections = [m for m in module.children() if isinstance(m, nn.Linear)]
            fully_shard(projections, mesh=mesh, mp_policy=policy)
            fully_shard(module, mesh=mesh, mp_policy=fp32_policy)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)


# --------------------------------------------------------------------------
# Training.
# --------------------------------------------------------------------------


def compile_note(args):
    if args.fsdp or args.cp:
        where = " and ".join(w for w, on in (("the FSDP hooks", args.fsdp), ("the CP collectives", args.cp)) if on)
        return f", compiled (graph breaks at {where})"
    return ", compiled (fullgraph)"


def progress_line(step, steps, loss, acc, tokens_per_s, width=24):
    filled = width * step // steps
    bar = "#" * filled + "." * (width - filled)
    rate = f"{tokens_per_s:,.0f} tok/s" if tokens_per_s is not None else "- tok/s"
    return f"\r[{bar}] step {step}/{steps}  loss {loss:.4f}  recall acc {acc:.3f}  {rate}"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=16, help="global batch, in sequences (split over the data-parallel rows with --fsdp)")
    p.add_argument("--seq-len", type=int, default=64, help="tokens per sequence (even)")
    p.add_argument("--num-queries", type=int, default=16, help="queries per sequence (the rest are key-value pairs)")
    p.add_argument("--vocab", type=int, default=64, help="vocabulary: half keys, half values")
    p.add_argument("--dim", type=int, default=64, help="model width")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=None, help="K = V; default 32 on CPU, 128 on CUDA (all the CUDA kernels serve)")
    p.add_argument(
        "--lower-bound", type=float, default=-5.0,
        help="the bounded gate's lower bound (< 0; CUDA serves [-5, 0)); default -5",
    )
    p.add_argument("--softplus-gate", action="store_true", help="the softplus gate of Kimi-Linear instead")
    p.add_argument("--lr", type=float, default=5e-3)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--clip", type=float, default=1.0, help="gradient-norm clipping; 0 turns it off")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--compile", action="store_true", help="torch.compile(model, fullgraph=True)")
    p.add_argument("--fsdp", action="store_true", help="FSDP2 fully_shard with a bf16 (or --dtype) MixedPrecisionPolicy")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16", help="FSDP param dtype (--fsdp only)")
    p.add_argument("--cp", type=int, default=0, metavar="N",
                   help="context parallelism over N ranks: each takes a slice of every sequence")
    p.add_argument("--loss-file", default=None, help="write the per-step losses as JSON here (rank 0)")
    p.add_argument("--log-every", type=int, default=1, help="update the progress line every N steps")
    args = p.parse_args(argv)
    if args.seq_len % 2 or args.seq_len // 2 - args.num_queries < args.num_queries:
        p.error("--seq-len must be even and hold at least as many pairs as queries (seq_len/2 >= 2 * num_queries)")
    if args.seq_len // 2 - args.num_queries > args.vocab // 2:
        p.error("more key-value pairs than distinct keys: raise --vocab or --num-queries, or lower --seq-len")
    if not args.lower_bound < 0:
        p.error("--lower-bound must be negative")
    if args.log_every < 1 or args.steps < 1:
        p.error("--steps and --log-every must be positive")
    if args.cp < 0:
        p.error("--cp must be a positive number of ranks")
    return args


def main(argv=None):
    args = parse_args(argv)
    device_type = args.device
    if device_type == "auto":
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    if device_type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is available")
    head_dim = args.head_dim or (128 if device_type == "cuda" else 32)
    lower_bound = None if args.softplus_gate else args.lower_bound

    rank, world, mesh = 0, 1, None
    device = torch.device(device_type)
    distributed = args.fsdp or args.cp
    if distributed:
        rank, world, device, mesh = setup_distributed(device_type, args.cp)
        if args.cp and not args.fsdp and args.cp != world:
            raise SystemExit(f"--cp {args.cp} without --fsdp must be the world size {world}")
        dp = mesh.size(0)
        if args.fsdp and args.batch_size % dp:
            raise SystemExit(f"--batch-size {args.batch_size} must be divisible by the data-parallel size {dp}")

    def log(*a, **kw):
        if rank == 0:
            print(*a, **kw, flush=True)

    try:
        _train(args, device, rank, world, mesh, head_dim, lower_bound, log)
        if distributed:
            # Every rank done before any tears down: a gloo group destroyed while a
            # peer still works aborts the process at exit.
            dist.barrier()
    finally:
        if distributed:
            dist.destroy_process_group()
    if distributed:
        # Seen here under load (torch 2.14, gloo): a distributed background thread still
        # joinable at interpreter teardown aborts an otherwise finished run ("terminate
        # called without an active exception"). Training is done and its outputs are
        # written and flushed, so leave without that teardown.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def _train(args, device, rank, world, mesh, head_dim, lower_bound, log):
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model = TinyLM(args.vocab, args.dim, args.layers, args.heads, head_dim, lower_bound).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    initial_gates = gate_values(model)

    dp, cp = (mesh.size(0), args.cp or 1) if mesh is not None else (1, 1)
    if args.fsdp:
        compute_dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
        shard_model(model, mesh, compute_dtype)
        autocast = torch.autocast(device.type, enabled=False)
        mode = f"FSDP2 over {world} process(es), param dtype {args.dtype}, gate params fp32"
        if args.cp:
            mode += f", context parallel: mesh dp {dp} x cp {cp}"
    elif device.type == "cuda":
        compute_dtype = torch.bfloat16
        autocast = torch.autocast("cuda", dtype=torch.bfloat16)
        mode = f"{world} process(es), context parallel, bf16 autocast" if args.cp else "single process, bf16 autocast"
    else:
        compute_dtype = torch.float32
        autocast = torch.autocast("cpu", enabled=False)
        mode = f"{world} process(es), context parallel, fp32" if args.cp else "single process, fp32"
    # Built before any forward: with FSDP2, model.parameters() are the sharded parameters only
    # while the modules are sharded.
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    gate = "softplus gate" if lower_bound is None else f"bounded gate (lower_bound {lower_bound:g})"
    log(
        f"TinyLM: {args.layers} KDA blocks, width {args.dim}, {args.heads} heads x {head_dim}, {gate}, "
        f"{n_params / 1e3:.1f}k params; {mode}; device {device}"
        f"{compile_note(args) if args.compile else ''}"
    )
    pairs = args.seq_len // 2 - args.num_queries
    log(
        f"task: associative recall, {pairs} pairs then {args.num_queries} queries per sequence of {args.seq_len} tokens, "
        f"vocab {args.vocab}; chance: loss {math.log(args.vocab - args.vocab // 2):.3f}, acc {1 / (args.vocab - args.vocab // 2):.3f}"
    )

    gen = torch.Generator().manual_seed(args.seed + 1)
    rows, cols = slice(None), slice(None)
    if args.fsdp:  # a slice of the sequences
        local, dp_rank = args.batch_size // dp, mesh.get_local_rank("dp")
        rows = slice(dp_rank * local, (dp_rank + 1) * local)
    cp_group = None
    if args.cp:  # a slice of every sequence's tokens
        cp_group, cp_rank = mesh.get_group("cp"), mesh.get_local_rank("cp")
        per_rank = -(-args.seq_len // cp)
        cols = slice(min(cp_rank * per_rank, args.seq_len), min((cp_rank + 1) * per_rank, args.seq_len))

    def next_batch():
        tokens, targets = recall_batch(gen, args.batch_size, args.seq_len, args.vocab, args.num_queries)
        # The loss is the mean over the rank's sequences; with --cp each rank sums its
        # positions of them over all their positions, and the parts add up to it.
        count = (targets[rows] != IGNORE_INDEX).sum()
        return tokens[rows, cols].to(device), targets[rows, cols].to(device), count.to(device)

    probe_gen = torch.Generator().manual_seed(args.seed + 2)  # leaves `gen` and the global RNG alone
    probe_tokens = recall_batch(probe_gen, args.batch_size, args.seq_len, args.vocab, args.num_queries)[0][rows, cols]
    check_operator_inputs(model, probe_tokens.to(device), autocast, compute_dtype, log, cp_group)
    if args.fsdp:
        # The probe ran without a backward, after which FSDP2 leaves the root's parameters
        # unsharded (and swapped in for the sharded ones): shard them again.
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()

    step_fn = model
    if args.compile:
        # FSDP2 keeps its hooks out of dynamo (torch._dynamo.disable), and the CP collectives
        # and halo offsets run eagerly, so neither compiles as one graph: the graph breaks there.
        step_fn = torch.compile(model, fullgraph=not (args.fsdp or args.cp))

    losses, accs, step_times = [], [], []
    tokens_per_step = args.batch_size * args.seq_len
    start = time.perf_counter()
    timed_from = None  # the rate leaves out step 1 (warm-up, and compilation with --compile)
    for step in range(1, args.steps + 1):
        step_start = time.perf_counter()
        tokens, targets, count = next_batch()
        with autocast:
            logits = step_fn(tokens, cp_group) if args.cp else step_fn(tokens)
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX,
                               reduction="sum") / count
        try:
            # FSDP2 averages gradients over all dp x cp ranks; the cp ranks' parts must add.
            (loss * cp if args.fsdp else loss).backward()
        except NotImplementedError as e:
            log()
            log(
                f"error: the backward of the KDA operator is not implemented on {device.type} in this build of "
                f"torch_kda, so this model cannot be trained there yet (the forward ran; see README, Status). "
                f"Train on the CPU with --device cpu.\n  {type(e).__name__}: {e}"
            )
            raise
        if args.cp and not args.fsdp and cp > 1:  # each rank's part of every replicated parameter's gradient
            for p in model.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad, group=cp_group)
        if args.clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

        with torch.no_grad():
            mask = targets != IGNORE_INDEX
            correct = (logits.argmax(-1)[mask] == targets[mask]).float().sum() / count
            stats = torch.stack([loss.detach().float(), correct])
            if args.cp and cp > 1:
                dist.all_reduce(stats, group=cp_group)  # the parts of one mean
            if args.fsdp and dp > 1:  # every dp row has the same number of queries: the mean of means is the mean
                dist.all_reduce(stats, group=mesh.get_group("dp"))
                stats /= dp
        loss_value, acc_value = stats.tolist()
        losses.append(loss_value)
        accs.append(acc_value)
        if not math.isfinite(loss_value):
            log()
            raise RuntimeError(f"loss is {loss_value} at step {step}")
        now = time.perf_counter()  # after .tolist() above, which waits for the device
        step_times.append(now - step_start)
        if step == 1:
            timed_from = now
        rate = tokens_per_step * (step - 1) / (now - timed_from) if step > 1 else None
        if step % args.log_every == 0 or step == args.steps:
            log(progress_line(step, args.steps, loss_value, acc_value, rate), end="")
    log()

    elapsed = time.perf_counter() - start
    rate = tokens_per_step * (args.steps - 1) / (time.perf_counter() - timed_from) if args.steps > 1 else float("nan")
    tail = max(1, min(20, args.steps // 10))
    log(f"first loss {losses[0]:.4f}, last loss {losses[-1]:.4f} (mean of the last {tail}: {sum(losses[-tail:]) / tail:.4f})")
    log(f"recall accuracy, mean of the last {tail} steps (each on a fresh batch): {sum(accs[-tail:]) / tail:.3f}")
    log(f"{args.steps} steps in {elapsed:.1f} s, {rate:,.0f} tokens/s (after step 1)")
    final_gates = gate_values(model)  # collective under FSDP: every rank runs it
    if args.loss_file and rank == 0:
        record = {
            "loss": losses,
            "recall_accuracy": accs,
            "tokens_per_s": rate,
            "step_time_s": step_times,
            "gate_params": {"initial": initial_gates, "final": final_gates},
            "args": vars(args),
        }
        with open(args.loss_file, "w") as f:
            json.dump(record, f)


if __name__ == "__main__":
    sys.exit(main())
