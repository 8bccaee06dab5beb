#!/usr/bin/env python3
"""cleave's block formats against llama.cpp's own Python reference (the `gguf` package, gguf-py).

1. Decoding: for every format, `cleave model synth --dtype T` writes a model; `cleave convert --to
   gguf --dtype f32` decodes every matrix with cleave's decode_row. gguf-py's dequantize of the
   original tensors must give the same f32 values, bit for bit.
2. Encoding: for the formats gguf-py has reference quantisers for (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0),
   cleave's encoding of an f32 model must give the same bytes as gguf-py's quantize.

usage: quant_reference.py CLEAVE_BINARY
Exit 77 (skip) when gguf-py is not installed; scripts/install-deps.sh installs it.
"""
import os
import subprocess
import sys
import tempfile

try:
    import numpy as np
    import gguf
    from gguf import quants
except ImportError as e:  # pragma: no cover
    print(f"skip: gguf-py is not installed ({e}); scripts/install-deps.sh installs it")
    sys.exit(77)

BLOCK = ["q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k"]
WITH_REFERENCE_QUANTISER = {"q4_0", "q4_1", "q5_0", "q5_1", "q8_0"}


def run(*args):
    r = subprocess.run(args, capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        sys.exit(f"{' '.join(args)} failed ({r.returncode}):\n{r.stderr}")


def tensors(path):
    return {t.name: t for t in gguf.GGUFReader(path).tensors}


def as_f32(t):
    """The tensor's values as [rows, cols] f32, through gguf-py's dequantize."""
    data = np.asarray(t.data)
    if t.tensor_type == gguf.GGMLQuantizationType.F32:
        return data.astype(np.float32).reshape(-1, int(t.shape[0]))
    out = quants.dequantize(data, t.tensor_type)
    return np.asarray(out, dtype=np.float32).reshape(-1, int(t.shape[0]))


def main():
    cleave = sys.argv[1]
    failures = 0
    with tempfile.TemporaryDirectory() as tmp:
        # dim and ffn multiples of 256 so that the K-quants need no fallback.
        geometry = ["--layers", "1", "--dim", "256", "--heads", "4", "--kv-heads", "2",
                    "--ffn", "512", "--vocab", "300"]
        f32 = os.path.join(tmp, "f32.gguf")
        run(cleave, "model", "synth", *geometry, "--dtype", "f32", "--seed", "3", "--out", f32)
        ref_f32 = tensors(f32)
        for dt in BLOCK:
            q = os.path.join(tmp, f"{dt}.gguf")
            back = os.path.join(tmp, f"{dt}-f32.gguf")
            run(cleave, "convert", "--to", "gguf", "--dtype", dt, f32, q)
            run(cleave, "convert", "--to", "gguf", "--dtype", "f32", q, back)
            qt, bt = tensors(q), tensors(back)
            checked = 0
            for name, t in qt.items():
                if len(t.shape) != 2:
                    continue
                if t.tensor_type.name.lower() != dt:
                    print(f"FAIL {dt} {name}: written as {t.tensor_type.name}")
                    failures += 1
                    continue
                theirs = as_f32(t)
                ours = as_f32(bt[name])
                if theirs.shape != ours.shape or not np.array_equal(
                        theirs.view(np.uint32), ours.view(np.uint32)):
                    diff = np.max(np.abs(theirs - ours)) if theirs.shape == ours.shape else "shape"
                    print(f"FAIL {dt} {name}: cleave's decoding differs from gguf-py's (max {diff})")
                    failures += 1
                checked += 1
                if dt in WITH_REFERENCE_QUANTISER:
                    src = as_f32(ref_f32[name])
                    ref_bytes = quants.quantize(src, t.tensor_type)
                    if not np.array_equal(np.asarray(ref_bytes).reshape(-1),
                                          np.asarray(t.data).reshape(-1).view(np.uint8)):
                        print(f"FAIL {dt} {name}: cleave's encoding differs from gguf-py's quantize")
                        failures += 1
            print(f"{dt}: {checked} matrices decoded as gguf-py decodes them"
                  + (", encoded as gguf-py encodes them" if dt in WITH_REFERENCE_QUANTISER else ""))
            if checked == 0:
                failures += 1
    if failures:
        sys.exit(f"{failures} failure(s)")
    print("all formats agree with gguf-py")


if __name__ == "__main__":
    main()
