#!/usr/bin/env python3
"""Rebuilds a usable vocab-only GGUF from a copy of a
llama.cpp tokenizer-suite file whose binary bytes went through a lossy UTF-8 conversion (every
byte that was not valid UTF-8 became EF BF BD). Token strings and merges survive such damage;
counts and numbers may not. The tokens, token types and merges are read by scanning, ignoring
the damaged counts. SentencePiece scores cannot be recovered: a score whose bytes survive is
kept, -1e9 is recognised by its surviving low bytes, and every other normal token gets -id (the
score pattern of SentencePiece BPE vocabularies); control/byte tokens get 0.
Usage: tokenizer_salvage_damaged_suite.py DAMAGED.gguf OUT.gguf
"""
import struct, sys
REPL = b"\xef\xbf\xbd"
src, dst, mode = sys.argv[1], sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else ""
d = open(src, "rb").read()

def key_pos(name):
    k = d.find(struct.pack("<Q", len(name)) + name)
    return k + 8 + len(name) if k >= 0 else -1

def items(p, n):
    out = []
    for _ in range(n):
        if d[p:p+3] == REPL: out.append(None); p += 3
        else: out.append(d[p]); p += 1
    return out, p

def chain_ok(q, n, depth):
    if b"\x00" in d[q:q+n]: return False
    try: d[q:q+n].decode("utf-8")
    except UnicodeDecodeError: return False
    if depth == 0: return True
    r2, q2 = items(q + n, 8)
    if not all(x is not None for x in r2): return False
    n2 = struct.unpack("<Q", bytes(r2))[0]
    return n2 < 4096 and chain_ok(q2, n2, depth - 1)

def str_list(name, stop_keys):
    p = key_pos(name)
    if p < 0: return None
    p += 4 + 4  # type, elem type
    for k in range(4, 16):  # the count may be damaged: find where the first string starts
        r0, q0 = items(p + k, 8)
        if all(x is not None for x in r0) and struct.unpack("<Q", bytes(r0))[0] < 4096 and chain_ok(q0, struct.unpack("<Q", bytes(r0))[0], 3):
            p = p + k
            break
    out = []
    while True:
        raw, q = items(p, 8)
        if all(x is not None for x in raw):
            n = struct.unpack("<Q", bytes(raw))[0]
        else:
            # find the length by scanning for the next length field
            i = raw.index(None)
            fits = []
            for v in range(0x80, 0x100):
                b = list(raw); b[i] = v
                n = struct.unpack("<Q", bytes(b))[0]
                if chain_ok(q, n, 3): fits.append(n)
            assert len(fits) == 1, (name, len(out), fits)
            n = fits[0]
        s = d[q:q+n]
        if any(s == k for k in stop_keys) or q + n > len(d): break
        out.append(s); p = q + n
        if p >= len(d): break
    return out

def str_val(name):
    p = key_pos(name) + 4
    n = struct.unpack("<Q", d[p:p+8])[0]
    return d[p+8:p+8+n]

keys = [b"tokenizer.ggml.tokens", b"tokenizer.ggml.token_type", b"tokenizer.ggml.merges", b"tokenizer.ggml.scores",
        b"tokenizer.ggml.bos_token_id", b"tokenizer.ggml.eos_token_id", b"tokenizer.ggml.unknown_token_id",
        b"tokenizer.ggml.padding_token_id", b"tokenizer.ggml.add_bos_token", b"tokenizer.ggml.add_eos_token",
        b"tokenizer.chat_template", b"tokenizer.ggml.add_space_prefix", b"tokenizer.ggml.seperator_token_id"]
model = str_val(b"tokenizer.ggml.model"); pre = str_val(b"tokenizer.ggml.pre")
tokens = str_list(b"tokenizer.ggml.tokens", keys)
merges = str_list(b"tokenizer.ggml.merges", keys)
p = key_pos(b"tokenizer.ggml.token_type") + 8
_, p = items(p, 8)
types = []
for i in range(len(tokens)):
    raw, p = items(p, 4); types.append(struct.unpack("<i", bytes(raw))[0])
kv = [(b"tokenizer.ggml.model", 8, model), (b"tokenizer.ggml.pre", 8, pre), (b"tokenizer.ggml.tokens", 9, tokens),
      (b"tokenizer.ggml.token_type", 95, types)]
if merges: kv.append((b"tokenizer.ggml.merges", 9, merges))
if model == b"llama":
    sp = key_pos(b"tokenizer.ggml.scores") + 8
    _, sp = items(sp, 8)
    scores = []
    for i in range(len(tokens)):
        raw, sp = items(sp, 4)
        if raw[:3] == [0x28, 0x6b, 0x6e]: scores.append(-1e9)
        elif all(x is not None for x in raw): scores.append(struct.unpack("<f", bytes(raw))[0])
        else: scores.append(float(-i) if types[i] == 1 else 0.0)
    kv.append((b"tokenizer.ggml.scores", 96, scores))
out = bytearray(b"GGUF" + struct.pack("<IQQ", 3, 0, len(kv)))
def ps(s): out.extend(struct.pack("<Q", len(s)) + s)
for k, t, v in kv:
    ps(k)
    if t == 8: out.extend(struct.pack("<I", 8)); ps(v)
    elif t == 9: out.extend(struct.pack("<IIQ", 9, 8, len(v))); [ps(x) for x in v]
    elif t == 95: out.extend(struct.pack("<IIQ", 9, 5, len(v))); [out.extend(struct.pack("<i", x)) for x in v]
    elif t == 96: out.extend(struct.pack("<IIQ", 9, 6, len(v))); [out.extend(struct.pack("<f", x)) for x in v]
open(dst, "wb").write(out)
print(src, model, pre, len(tokens), len(merges or []), len(types))
