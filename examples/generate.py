#!/usr/bin/env python3
"""Generation from a state cache with KimiDeltaAttention layers.

    python examples/generate.py                 # the GPU if there is one, else the CPU
    python examples/generate.py --device cpu --new-tokens 16

A small model in Kimi-Linear's layout (embedding, --layers decoder layers of RMSNorm
-> KimiDeltaAttention -> residual and RMSNorm -> MLP -> residual, a norm and a
linear head) is described by a config dict such as a Kimi-Linear config.json holds
(hidden_size, rms_norm_eps, linear_attn_config), built from it on the device, and
loads its weights with load_state_dict(strict=True) from a state dict whose names,
shapes and dtypes are a checkpoint's (model.layers.{i}.self_attn.q_proj.weight, ...;
random here): the path that real Kimi-Linear KDA weights take. It prefills a batch
of prompts of different lengths, packed with cu_seqlens, into a KDACache per layer
(request slots in a random order of the pool), then decodes --new-tokens tokens
greedily, one token per request a step. It checks that the decoded logits equal a
full forward over each prompt plus its generated tokens (the training path,
torch_kda.kda, from zero states) and prints the decode steps' tokens/s, eagerly and,
on the GPU, as a CUDA graph of one step replayed. On the GPU the model has 8 layers
of 16 heads of 128 by default (a width whose decode time the KDA layers and their
projections share), on the CPU 2 layers of 2 heads of 32. Exits non-zero if the
check fails.
"""
import argparse
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

import torch_kda
from torch_kda.nn import KDACache, KimiDeltaAttention


class RMSNorm(nn.Module):
    def __init__(self, dim, eps, device=None, dtype=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


class MLP(nn.Module):
    def __init__(self, dim, hidden, **factory):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False, **factory)
        self.up_proj = nn.Linear(dim, hidden, bias=False, **factory)
        self.down_proj = nn.Linear(hidden, dim, bias=False, **factory)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx, **factory):
        super().__init__()
        dim, eps = config["hidden_size"], config["rms_norm_eps"]
        self.input_layernorm = RMSNorm(dim, eps, **factory)
        self.self_attn = KimiDeltaAttention.from_config(config, layer_idx, **factory)
        self.post_attention_layernorm = RMSNorm(dim, eps, **factory)
        self.mlp = MLP(dim, config["intermediate_size"], **factory)

    def forward(self, x, cu_seqlens=None, cache=None, slots=None):
        h = self.input_layernorm(x)
        if cache is None:
            a = self.self_attn(h, cu_seqlens)[0]
        else:
            a = self.self_attn.forward_cached(h, cache, slots, cu_seqlens)
        x = x + a
        return x + self.mlp(self.post_attention_layernorm(x))


class Model(nn.Module):
    def __init__(self, config, **factory):
        super().__init__()
        self.embed_tokens = nn.Embedding(config["vocab_size"], config["hidden_size"], **factory)
        self.layers = nn.ModuleList(DecoderLayer(config, i, **factory) for i in range(config["num_hidden_layers"]))
        self.norm = RMSNorm(config["hidden_size"], config["rms_norm_eps"], **factory)


class CausalLM(nn.Module):
    def __init__(self, config, device=None, dtype=None):
        super().__init__()
        self.model = Model(config, device=device, dtype=dtype)
        self.lm_head = nn.Linear(config["hidden_size"], config["vocab_size"], bias=False, device=device, dtype=dtype)

    def forward(self, tokens, cu_seqlens=None, caches=None, slots=None):
        x = self.model.embed_tokens(tokens)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cu_seqlens, None if caches is None else caches[i], slots)
        return self.lm_head(self.model.norm(x)).float()


def small_config(vocab, dim, layers, heads, head_dim):
    """A config in Kimi-Linear's form, every layer a KDA layer (kda_layers is 1-based)."""
    return {
        "vocab_size": vocab, "hidden_size": dim, "intermediate_size": 4 * dim, "num_hidden_layers": layers,
        "rms_norm_eps": 1e-5,
        "linear_attn_config": {"num_heads": heads, "head_dim": head_dim, "short_conv_kernel_size": 4,
                               "kda_layers": list(range(1, layers + 1)), "full_attn_layers": []},
    }


def random_checkpoint(config, dtype):
    """A state dict as a checkpoint stores it: the weights in `dtype`, the KDA layers'
    A_log, dt_bias and convolution weights in fp32; values from the modules' own
    initialisation."""
    model = CausalLM(config)  # fp32, on the CPU
    keep_fp32 = ("A_log", "dt_bias", "conv1d.weight")
    return {name: t if name.endswith(keep_fp32) else t.to(dtype) for name, t in model.state_dict().items()}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    ap.add_argument("--prompts", default="7,30,1,16", help="prompt lengths, comma-separated")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--layers", type=int, default=None, help="default: 8 on the GPU, 2 on the CPU")
    ap.add_argument("--dim", type=int, default=None, help="default: heads x head size on the GPU, 256 on the CPU")
    ap.add_argument("--heads", type=int, default=None, help="default: 16 on the GPU, 2 on the CPU")
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    cuda_ok = torch.cuda.is_available() and torch_kda.cuda_built()
    if args.device == "cuda" and not cuda_ok:
        sys.exit("--device cuda asked for, but there is no CUDA device or this build has no CUDA kernels")
    device = torch.device("cuda" if args.device == "cuda" or (args.device == "auto" and cuda_ok) else "cpu")
    # The CUDA kernels take bf16 activations and K = V = 128; the CPU any dtype and size.
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    head_dim = 128 if device.type == "cuda" else 32
    on_gpu = device.type == "cuda"
    args.layers = args.layers or (8 if on_gpu else 2)
    args.heads = args.heads or (16 if on_gpu else 2)
    args.dim = args.dim or (args.heads * head_dim if on_gpu else 256)
    torch.manual_seed(args.seed)
    config = small_config(args.vocab, args.dim, args.layers, args.heads, head_dim)
    checkpoint = random_checkpoint(config, dtype)
    model = CausalLM(config, device=device, dtype=dtype)
    model.load_state_dict(checkpoint, strict=True)
    model.eval()
    lengths = [int(x) for x in args.prompts.split(",")]
    N = len(lengths)
    print(f"device: {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}), "
          f"{args.layers} layers, {args.heads} heads of {head_dim}, prompts {lengths}")

    slots_total = 2 * N
    caches = [KDACache(layer.self_attn, slots_total) for layer in model.model.layers]
    slots = torch.randperm(slots_total, device=device)[:N]
    prompts = [torch.randint(args.vocab, (n,), device=device) for n in lengths]
    cu = torch.tensor([0] + lengths, device=device).cumsum(0)
    with torch.no_grad():
        logits = model(torch.cat(prompts)[None], cu, caches, slots)  # prefill
        last = logits[0, cu[1:] - 1]
        generated, decoded = [], []
        step_tokens = last.argmax(-1)[:, None]  # [N, 1]
        start = time.perf_counter()
        for _ in range(args.new_tokens):
            generated.append(step_tokens)
            step_logits = model(step_tokens, None, caches, slots)  # [N, 1, vocab]
            decoded.append(step_logits)
            step_tokens = step_logits.argmax(-1)
        if device.type == "cuda":
            torch.cuda.synchronize()
        eager_s = time.perf_counter() - start
        print(f"decode, eager: {N * args.new_tokens / eager_s:.1f} tokens/s "
              f"({args.new_tokens} steps of {N} requests)")

        # The training path over prompt + generated tokens, from zero states.
        gen = torch.cat(generated, 1)  # [N, new]
        full = [torch.cat([p, gen[n]]) for n, p in enumerate(prompts)]
        full_cu = torch.tensor([0] + [len(f) for f in full], device=device).cumsum(0)
        ref = model(torch.cat(full)[None], full_cu)[0]
        want = torch.stack([ref[full_cu[n] + lengths[n] : full_cu[n + 1]] for n in range(N)])  # [N, new, vocab]
        got = torch.cat(decoded, 1)
        err = ((got - want).norm() / want.norm()).item()
        tol = 3e-2 if device.type == "cuda" else 1e-4
        print(f"decoded logits against the full forward: relative error {err:.2e} (tolerance {tol:.0e})")
        if not err <= tol:
            sys.exit("the decoded logits do not match the full forward")

        if device.type == "cuda":
            static_tokens = step_tokens.clone()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                model(static_tokens, None, caches, slots)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                static_logits = model(static_tokens, None, caches, slots)
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(args.new_tokens):
                graph.replay()
                static_tokens.copy_(static_logits.argmax(-1))
            torch.cuda.synchronize()
            graph_s = time.perf_counter() - start
            print(f"decode, CUDA graph of one step: {N * args.new_tokens / graph_s:.1f} tokens/s")
    print("All checks passed.")


if __name__ == "__main__":
    main()
