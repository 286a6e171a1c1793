"""Where a kernel's instructions go, without a GPU: its SASS by source line.

    python3 tools/sass_lines.py FILE.cu KERNEL_REGEX [--top N]

Compiles FILE.cu for sm_90a with line information (the flags of sass_compare.py),
disassembles each kernel whose demangled name matches KERNEL_REGEX with nvdisasm's
line table, and prints its instruction count, the count per source file, and the N
source lines with the most instructions, each with its instructions by class
(integer and uniform, shared and global memory, floating point, tensor cores, ...).
The counts are static: an unrolled loop appears whole, both sides of a branch count,
and inlined code is charged to its innermost line. Needs nvcc (CUDA_HOME) and
cuobjdump and nvdisasm (CUDA_HOME/bin, else Triton's copies).
"""
import argparse
import collections
import glob
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sass_compare import ROOT, demangle, nvcc_command, tool  # noqa: E402

CLASSES = [
    ("int", re.compile(r"^(IMAD|IADD3|IADD|SHF|LEA|LOP3|ISETP|VIADD|SEL|MOV|PRMT|IABS|IMNMX|VIMNMX|P2R|R2P|CS2R|S2R|"
                       r"LDC|POPC|FLO|BREV|PLOP3)\b")),
    ("uniform", re.compile(r"^U[A-Z0-9]+")),
    ("shared", re.compile(r"^(LDS|STS|LDSM|STSM|ATOMS)\b")),
    ("global", re.compile(r"^(LDG|STG|LDGSTS|RED|ATOMG|UBLKCP|UTMALDG|UTMASTG)\b")),
    ("local", re.compile(r"^(LDL|STL)\b")),
    ("float", re.compile(r"^(FFMA|FADD|FMUL|FMNMX|FSETP|FSEL|F2FP|F2F|MUFU|I2F|F2I|FCHK|FRND)\b")),
    ("tensor", re.compile(r"^(HMMA|HGMMA|IMMA)\b")),
    ("control", re.compile(r"^(BRA|BSSY|BSYNC|BAR|EXIT|CALL|RET|WARPSYNC|NOP|YIELD|SHFL|VOTE|MEMBAR|ERRBAR|"
                           r"CGAERRBAR|UCGABAR_ARV|UCGABAR_WAIT|DEPBAR)\b")),
]


def compile_cubin(path, workdir):
    obj = os.path.join(workdir, "k.o")
    run = subprocess.run(nvcc_command(ROOT, path, obj, "-lineinfo"), capture_output=True, text=True)
    if run.returncode != 0:
        sys.exit(f"sass_lines: {path} does not compile:\n{run.stderr[-3000:]}")
    subprocess.run([tool("cuobjdump"), "-xelf", "all", obj], cwd=workdir, capture_output=True, check=True)
    cubins = glob.glob(os.path.join(workdir, "*.cubin"))
    if not cubins:
        sys.exit("sass_lines: cuobjdump extracted no cubin")
    return cubins[0]


def kernels_by_line(cubin):
    """{mangled kernel: Counter of (file, line, class)} from nvdisasm's line table."""
    text = subprocess.run([tool("nvdisasm"), "-g", "-c", cubin], capture_output=True, text=True, check=True).stdout
    kernels, name, where = {}, None, None
    for line in text.splitlines():
        m = re.match(r"\s*\.text\.(\S+):\s*$", line) or re.match(r"^\.text\.(\S+):", line)
        if m:
            name, where = m.group(1), None
            kernels[name] = collections.Counter()
            continue
        m = re.search(r'//## File "(.*?)", line (\d+)', line)
        if m:
            where = (os.path.relpath(m.group(1), ROOT) if m.group(1).startswith(ROOT) else os.path.basename(m.group(1)),
                     int(m.group(2)))
            continue
        m = re.match(r"\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", line)
        if m and name is not None:
            op = m.group(1)
            cls = next((c for c, pattern in CLASSES if pattern.match(op)), "other")
            kernels[name][(*(where or ("?", 0)), cls)] += 1
    return kernels


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("file")
    ap.add_argument("kernel", help="a regular expression on the demangled kernel names")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as workdir:
        kernels = kernels_by_line(compile_cubin(args.file, workdir))
    names = demangle(list(kernels))
    chosen = [k for k in kernels if re.search(args.kernel, names[k])]
    if not chosen:
        sys.exit(f"sass_lines: no kernel of {args.file} matches {args.kernel!r}")
    for k in chosen:
        counts = kernels[k]
        total = sum(counts.values())
        by_file, by_line = collections.Counter(), collections.defaultdict(collections.Counter)
        for (f, n, cls), c in counts.items():
            by_file[f] += c
            by_line[(f, n)][cls] += c
        print(f"== {names[k]}: {total} instructions")
        print("   by file: " + ", ".join(f"{f} {c}" for f, c in by_file.most_common()))
        for (f, n), classes in sorted(by_line.items(), key=lambda x: -sum(x[1].values()))[:args.top]:
            detail = ", ".join(f"{cls} {c}" for cls, c in classes.most_common())
            print(f"   {sum(classes.values()):6d}  {f}:{n}  ({detail})")


if __name__ == "__main__":
    main()
