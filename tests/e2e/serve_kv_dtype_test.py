"""End-to-end: `cleave serve` on stories260K with engine.kv_dtype f16 and bf16. Disaggregated
(the KV goes from the prefill worker's f16/bf16 pool to the decode worker's over the transfer
engine) gives exactly the tokens and logprobs of unified mode with the same KV dtype; the text
stays the f32 pool's on this prompt while the logprobs show the pool is not f32.

Usage: python3 serve_kv_dtype_test.py CLEAVE_BINARY MODELS_DIR
"""

import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import serve_harness as h  # noqa: E402

PROMPTS = ["Once upon a time", "Lily and Ben went to the park. They saw a big"]


def run(mode, dtype):
    s = h.serve("--set", f"router.mode={mode}", "--set", f"engine.kv_dtype={dtype}",
                name=f"serve-{mode}-{dtype}")
    try:
        c = h.client(s)
        model = c.models.list().data[0].id
        out = []
        for p in PROMPTS:
            r = c.completions.create(model=model, prompt=p, max_tokens=48, temperature=0,
                                     logprobs=2)
            out.append((r.choices[0].text, r.choices[0].logprobs.token_logprobs))
        return out
    finally:
        s.stop()


class KvDtypeServeTest(unittest.TestCase):
    def test_disaggregated_equals_unified_for_each_kv_dtype(self):
        f32 = run("unified", "f32")
        for dtype in ("f16", "bf16"):
            unified = run("unified", dtype)
            disaggregated = run("disaggregated", dtype)
            self.assertEqual(disaggregated, unified, dtype)
            self.assertNotEqual([lp for _, lp in unified], [lp for _, lp in f32], dtype)
            for (text, lp), (text32, lp32) in zip(unified, f32):
                self.assertEqual(len(lp), len(lp32))
                if dtype == "f16":
                    self.assertEqual(text, text32)


if __name__ == "__main__":
    h.harness_main()
