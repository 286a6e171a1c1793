"""Compare the kernels of the working tree with those of an earlier commit, without a GPU.

    python3 tools/sass_compare.py REV [FILE.cu ...] [--renamed NEW=OLD ...] [--kernel-renamed NEW=OLD ...]

Compiles each .cu file (default: every csrc/cuda/**/*.cu) in both trees for sm_90a,
with setup.py's flags, and prints per kernel instance: the registers, spills and
instruction count on both sides, and whether the SASS is identical, or has the same multiset of
floating-point instructions (the same arithmetic in another order of issue: integer
address code and scheduling differ), or differs in its arithmetic. A refactor that
must keep results bitwise should end with no "differs" line; the GPU suite still
decides. Kernels are matched by demangled name; --renamed maps a file's new path to
its old one, --kernel-renamed NEW=OLD a text in the new kernels' names to the old
(e.g. 'prepare_kernel<128, =prepare_kernel<' where a template parameter was added). Needs nvcc (CUDA_HOME) and cuobjdump (CUDA_HOME/bin, else Triton's copy).
"""
import argparse
import collections
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile

import torch.utils.cpp_extension as cpp_extension

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLOAT_OPS = re.compile(r"^(FFMA|FADD|FMUL|FMNMX|FSETP|FSEL|HMMA|HGMMA|F2FP|F2F|MUFU|I2F|F2I)\b")


def tool(name):
    home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    for path in [os.path.join(home, "bin", name), shutil.which(name)]:
        if path and os.path.exists(path):
            return path
    try:
        import triton

        path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)
        if os.path.exists(path):
            return path
    except ImportError:
        pass
    sys.exit(f"sass_compare: {name} not found")


def nvcc_command(tree, path, obj, *extra):
    """nvcc compiling one .cu file of a tree for sm_90a into obj (the tools' flags)."""
    includes = [f"-I{p}" for p in cpp_extension.include_paths()] + [f"-I{os.path.join(tree, 'csrc')}"]
    includes += [f"-I{p}" for p in glob.glob(os.path.join(sys.prefix, "lib", "python3*", "site-packages", "nvidia", "cu*", "include"))]
    return [tool("nvcc"), "-std=c++17", "-O3", "--expt-relaxed-constexpr", "-gencode", "arch=compute_90a,code=sm_90a",
            "-DTORCH_KDA_WITH_CUDA", "-D_GLIBCXX_USE_CXX11_ABI=1", *extra, *includes, "-c", os.path.join(tree, path),
            "-o", obj]


def compile_kernels(tree, path, workdir):
    """{kernel: (sass lines, registers, spill bytes)} of one .cu file of a tree."""
    obj = os.path.join(workdir, "k.o")
    run = subprocess.run(nvcc_command(tree, path, obj, "-Xptxas", "-v"), capture_output=True, text=True)
    if run.returncode != 0:
        sys.exit(f"sass_compare: {path} does not compile in {tree}:\n{run.stderr[-3000:]}")
    usage, current = {}, None
    for line in run.stderr.splitlines():
        m = re.search(r"Compiling entry function '(\S+)'", line)
        if m:
            current = m.group(1)
        m = re.search(r"(\d+) bytes spill stores", line)
        if m and current:
            usage.setdefault(current, [0, 0])[1] = int(m.group(1))
        m = re.search(r"Used (\d+) registers", line)
        if m and current:
            usage.setdefault(current, [0, 0])[0] = int(m.group(1))
    sass = subprocess.run([tool("cuobjdump"), "-sass", obj], capture_output=True, text=True, check=True).stdout
    kernels, name = {}, None
    for line in sass.splitlines():
        m = re.match(r"\s*Function : (\S+)", line)
        if m:
            name = m.group(1)
            kernels[name] = []
            continue
        text = re.sub(r"/\*[0-9a-f]{4,}\*/|/\* 0x[0-9a-f]+ \*/", "", line).strip()
        if name and text and not text.startswith("."):
            kernels[name].append(re.sub(r"c\[0x0\]\[0x[0-9a-f]+\]", "c[param]", text))
    names = demangle(list(kernels))
    return {names[k]: (v, *usage.get(k, (0, 0))) for k, v in kernels.items()}


def demangle(names):
    out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True).stdout.splitlines()
    # Anonymous namespaces carry a hash of the file's path.
    return {n: re.sub(r"\(anonymous namespace\)::|_GLOBAL__N_\w+::", "", d) for n, d in zip(names, out)}


def float_ops(lines):
    ops = collections.Counter()
    for line in lines:
        text = re.sub(r"^@!?U?P\w+\s+", "", line)
        if FLOAT_OPS.match(text):
            # Registers and their operand-reuse hints are the allocator's and the scheduler's.
            ops[re.sub(r"\bU?[RP]\d+\b", "R", text.replace(".reuse", ""))] += 1
    return ops


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("rev")
    ap.add_argument("files", nargs="*")
    ap.add_argument("--renamed", action="append", default=[], help="NEW=OLD: the file's path at REV")
    ap.add_argument("--kernel-renamed", action="append", default=[],
                    help="NEW=OLD: a text in the new kernels' names and its form at REV")
    args = ap.parse_args()
    renamed = dict(r.split("=", 1) for r in args.renamed)
    files = args.files or sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "csrc/cuda/**/*.cu"), recursive=True))
    with tempfile.TemporaryDirectory() as tmp:
        base = os.path.join(tmp, "base")
        subprocess.run(["git", "-C", ROOT, "worktree", "add", "--detach", "-q", base, args.rev], check=True)
        try:
            differs = 0
            for path in files:
                new = compile_kernels(ROOT, path, tmp)
                for rule in args.kernel_renamed:
                    text, old_text = rule.split("=", 1)
                    renamed_new = {name.replace(text, old_text): v for name, v in new.items()}
                    assert len(renamed_new) == len(new), f"--kernel-renamed {rule} maps two kernels to one name"
                    new = renamed_new
                old = compile_kernels(base, renamed.get(path, path), tmp)
                print(f"== {path}: {len(old)} kernels at {args.rev}, {len(new)} now")
                for name, (lines, regs, spill) in sorted(new.items()):
                    if name not in old:
                        print(f"  new        {name}  {regs} regs, {spill} B spilled")
                        continue
                    o_lines, o_regs, o_spill = old[name]
                    verdict = ("identical" if lines == o_lines
                               else "same float" if float_ops(lines) == float_ops(o_lines) else "DIFFERS")
                    differs += verdict == "DIFFERS"
                    print(f"  {verdict:<10} {name}  regs {o_regs} -> {regs}, spilled {o_spill} -> {spill} B, "
                          f"{len(o_lines)} -> {len(lines)} instructions")
                for name in sorted(set(old) - set(new)):
                    print(f"  gone       {name}")
            print(f"{differs} kernel(s) with different arithmetic")
        finally:
            subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", base], check=False)


if __name__ == "__main__":
    main()
