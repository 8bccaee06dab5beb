"""End-to-end: prompt log-probabilities (`/v1/completions` with echo, logprobs and max_tokens 0,
as vLLM and lm-evaluation-harness use them) through `cleave serve` on stories260K, in
disaggregated mode (the prefill worker computes them) and in unified mode, with the official
`openai` client.

Checked against an independent path: the logprob of prompt token k and the top N at its position
must equal what the sampler reports for the first generated token of the prompt cut before k
(max_tokens 1, greedy, logprobs N), which comes from the last-token logits, not from the scoring
path.

Usage: python3 serve_logprobs_test.py CLEAVE_BINARY MODELS_DIR
"""

import math
import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import serve_harness as h  # noqa: E402

PROMPT = "Once upon a time, there was a little girl named Lily. She loved"


class PromptLogprobsCases:
    serve = None
    mode = None

    @classmethod
    def setUpClass(cls):
        cls.serve = h.serve("--set", f"router.mode={cls.mode}")
        cls.client = h.client(cls.serve)
        cls.model = cls.client.models.list().data[0].id

    @classmethod
    def tearDownClass(cls):
        if cls.serve is not None:
            cls.serve.stop()

    def echo(self, prompt, n, max_tokens=0):
        return self.client.completions.create(model=self.model, prompt=prompt, echo=True,
                                              logprobs=n, max_tokens=max_tokens, temperature=0)

    def test_prompt_logprobs_match_the_sampler(self):
        r = self.echo(PROMPT, 3)
        c = r.choices[0]
        lp = c.logprobs
        self.assertEqual(c.text, PROMPT)
        self.assertEqual(r.usage.completion_tokens, 0)
        n = r.usage.prompt_tokens
        self.assertGreater(n, 8)
        self.assertEqual(len(lp.tokens), n)
        self.assertEqual(len(lp.token_logprobs), n)
        self.assertEqual(len(lp.top_logprobs), n)
        self.assertEqual(len(lp.text_offset), n)
        self.assertIsNone(lp.token_logprobs[0])
        self.assertIsNone(lp.top_logprobs[0])
        self.assertEqual(lp.text_offset[0], 0)
        for k in range(1, n):
            self.assertLess(lp.token_logprobs[k], 0.0)
            self.assertGreaterEqual(lp.text_offset[k], lp.text_offset[k - 1])
            top = lp.top_logprobs[k]
            # The top 3 and the prompt token itself when it is not among them.
            self.assertIn(len(top), (3, 4))
            self.assertAlmostEqual(top[lp.tokens[k]], lp.token_logprobs[k], places=5)
            self.assertLessEqual(sum(math.exp(v) for v in top.values()), 1.0 + 1e-5)

        # The prompt's token ids (echo of the ids gives the same figures), then each prefix.
        ids = self.prompt_ids(PROMPT)
        self.assertEqual(len(ids), n)
        by_ids = self.echo([ids], 3).choices[0].logprobs
        self.assertEqual(by_ids.token_logprobs, lp.token_logprobs)
        for k in (1, 2, n // 2, n - 1):
            g = self.client.completions.create(model=self.model, prompt=[ids[:k]], max_tokens=1,
                                               temperature=0, logprobs=3).choices[0].logprobs
            gen_top = g.top_logprobs[0]
            prompt_top = dict(lp.top_logprobs[k])
            if lp.tokens[k] not in sorted(gen_top, key=gen_top.get, reverse=True)[:3]:
                prompt_top.pop(lp.tokens[k])
            self.assertEqual(sorted(prompt_top), sorted(gen_top))
            for tok, v in gen_top.items():
                self.assertAlmostEqual(prompt_top[tok], v, places=5, msg=f"position {k} {tok!r}")

    def prompt_ids(self, text):
        """The ids the router makes of `text` (BOS first, as the model adds it)."""
        import subprocess
        out = subprocess.run([h.CLEAVE, "tokenize", "--model", h.model_path(), "--text", text,
                              "--add-bos", "--parse-special"], capture_output=True, text=True,
                             check=True, timeout=60)
        return [int(t) for t in out.stdout.split()]

    def test_echo_with_generation_appends_the_generated_tokens(self):
        r = self.echo(PROMPT, 1, max_tokens=4)
        c = r.choices[0]
        n = r.usage.prompt_tokens
        self.assertEqual(r.usage.completion_tokens, 4)
        self.assertEqual(len(c.logprobs.tokens), n + 4)
        self.assertTrue(c.text.startswith(PROMPT))
        self.assertEqual(c.logprobs.token_logprobs[:n], self.echo(PROMPT, 1).choices[0]
                         .logprobs.token_logprobs)

    def test_bad_requests_are_400(self):
        import openai
        cases = [dict(logprobs=21, max_tokens=0, echo=True),
                 dict(logprobs=2, max_tokens=0, echo=False),
                 dict(logprobs=2, max_tokens=0, echo=True, stream=True)]
        for kw in cases:
            with self.assertRaises(openai.BadRequestError, msg=str(kw)) as cm:
                r = self.client.completions.create(model=self.model, prompt=PROMPT, **kw)
                if kw.get("stream"):
                    list(r)
            self.assertEqual(cm.exception.status_code, 400)


class Disaggregated(PromptLogprobsCases, unittest.TestCase):
    mode = "disaggregated"


class Unified(PromptLogprobsCases, unittest.TestCase):
    mode = "unified"


if __name__ == "__main__":
    h.harness_main()
