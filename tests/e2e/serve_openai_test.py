"""End-to-end: `cleave serve` with stories260K, disaggregated (one prefill, one decode worker),
driven by the official `openai` Python package. A second process, `cleave router` against the
same workers with API keys and a queue of two, checks authentication and backpressure.

Usage: python3 serve_openai_test.py CLEAVE_BINARY MODELS_DIR
"""

import concurrent.futures
import json
import os
import sys
import threading
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import serve_harness as h  # noqa: E402


class ServeOpenAITest(unittest.TestCase):
    serve = None

    @classmethod
    def setUpClass(cls):
        cls.serve = h.serve()
        cls.client = h.client(cls.serve)
        models = cls.client.models.list().data
        cls.model = models[0].id

    @classmethod
    def tearDownClass(cls):
        if cls.serve is not None:
            cls.serve.stop()

    def complete(self, **kw):
        kw.setdefault("model", self.model)
        return self.client.completions.create(**kw)

    def stream_text(self, resp, chat=False):
        """(text, finish_reason, usage, chunks) of a stream."""
        text, finish, usage, chunks = "", None, None, 0
        for chunk in resp:
            chunks += 1
            if chunk.usage is not None:
                usage = chunk.usage
            for c in chunk.choices:
                piece = c.delta.content if chat else c.text
                text += piece or ""
                if c.finish_reason:
                    finish = c.finish_reason
        return text, finish, usage, chunks

    def test_models(self):
        models = self.client.models.list().data
        self.assertEqual(len(models), 1)
        self.assertEqual(self.client.models.retrieve(self.model).id, self.model)

    def test_golden_greedy_empty_prompt(self):
        r = self.complete(prompt="", max_tokens=200, temperature=0)
        self.assertEqual(r.choices[0].text, h.golden_text())
        self.assertEqual(r.usage.prompt_tokens, 1)  # BOS alone
        self.assertEqual(r.usage.completion_tokens, 200)
        self.assertEqual(r.usage.total_tokens, 201)
        self.assertEqual(r.choices[0].finish_reason, "length")

    def test_completion_streaming_matches_non_streaming(self):
        full = self.complete(prompt="Once upon a time", max_tokens=48, temperature=0)
        stream = self.complete(prompt="Once upon a time", max_tokens=48, temperature=0,
                               stream=True, stream_options={"include_usage": True})
        text, finish, usage, chunks = self.stream_text(stream)
        self.assertEqual(text, full.choices[0].text)
        self.assertEqual(finish, full.choices[0].finish_reason)
        self.assertGreater(chunks, 2)
        self.assertIsNotNone(usage)
        self.assertEqual(usage.prompt_tokens, full.usage.prompt_tokens)
        self.assertEqual(usage.completion_tokens, full.usage.completion_tokens)
        self.assertGreater(full.usage.prompt_tokens, 1)

    def test_chat_streaming_and_not(self):
        messages = [{"role": "user", "content": "Tell me a story about a cat."}]
        full = self.client.chat.completions.create(model=self.model, messages=messages,
                                                   max_tokens=40, temperature=0)
        msg = full.choices[0].message
        self.assertEqual(msg.role, "assistant")
        self.assertTrue(msg.content)
        self.assertIn(full.choices[0].finish_reason, ("stop", "length"))
        self.assertGreater(full.usage.prompt_tokens, 5)
        self.assertLessEqual(full.usage.completion_tokens, 40)
        self.assertEqual(full.usage.total_tokens,
                         full.usage.prompt_tokens + full.usage.completion_tokens)

        stream = self.client.chat.completions.create(model=self.model, messages=messages,
                                                     max_tokens=40, temperature=0, stream=True,
                                                     stream_options={"include_usage": True})
        first = None
        text, finish, usage = "", None, None
        for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for c in chunk.choices:
                if first is None:
                    first = c.delta
                text += c.delta.content or ""
                finish = c.finish_reason or finish
        self.assertEqual(first.role, "assistant")
        self.assertEqual(text, msg.content)
        self.assertEqual(finish, full.choices[0].finish_reason)
        self.assertEqual(usage.completion_tokens, full.usage.completion_tokens)

    def test_stop_strings(self):
        golden = h.golden_text()
        stop = "park"
        cut = golden.index(stop)
        r = self.complete(prompt="", max_tokens=200, temperature=0, stop=[stop, "zzzz"])
        self.assertEqual(r.choices[0].text, golden[:cut])
        self.assertEqual(r.choices[0].finish_reason, "stop")
        stream = self.complete(prompt="", max_tokens=200, temperature=0, stop=stop, stream=True)
        text, finish, _, _ = self.stream_text(stream)
        self.assertEqual(text, golden[:cut])
        self.assertEqual(finish, "stop")

    def test_seeded_sampling_reproducible(self):
        kw = dict(prompt="The dog", max_tokens=40, temperature=1.0, top_p=0.95)
        a = self.complete(seed=1234, **kw).choices[0].text
        b = self.complete(seed=1234, **kw).choices[0].text
        self.assertEqual(a, b)
        streamed, _, _, _ = self.stream_text(self.complete(seed=1234, stream=True, **kw))
        self.assertEqual(streamed, a)
        others = {self.complete(seed=s, **kw).choices[0].text for s in (1, 2, 3)}
        self.assertTrue(others - {a}, "three other seeds all gave the seed-1234 text")
        chat_kw = dict(model=self.model, messages=[{"role": "user", "content": "Hi"}],
                       max_tokens=30, temperature=0.9, seed=99)
        c1 = self.client.chat.completions.create(**chat_kw).choices[0].message.content
        c2 = self.client.chat.completions.create(**chat_kw).choices[0].message.content
        self.assertEqual(c1, c2)

    def test_bad_requests(self):
        import openai
        with self.assertRaises(openai.BadRequestError):
            self.complete(prompt="x", max_tokens=8, temperature=-1)
        with self.assertRaises(openai.BadRequestError):
            self.complete(prompt="x", max_tokens=-3)
        with self.assertRaises(openai.BadRequestError):
            self.complete(prompt="x", max_tokens=8, extra_body={"no_such_parameter": 1})
        with self.assertRaises(openai.BadRequestError):
            self.client.chat.completions.create(model=self.model, messages=[], max_tokens=8)
        # Context overflow: a prompt longer than the model's 2048 positions, and a max_tokens
        # that does not fit after a short one.
        with self.assertRaises(openai.BadRequestError) as ctx:
            self.complete(prompt=[5] * 3000, max_tokens=8)
        self.assertEqual(ctx.exception.code, "context_length_exceeded")
        self.assertIn("3000", ctx.exception.message)
        with self.assertRaises(openai.BadRequestError) as ctx:
            self.complete(prompt="Once", max_tokens=100000)
        self.assertEqual(ctx.exception.code, "context_length_exceeded")
        # The server still serves after all of these.
        self.assertTrue(self.complete(prompt="Once", max_tokens=4).choices[0].text)

    def test_unknown_model(self):
        import openai
        with self.assertRaises(openai.NotFoundError):
            self.complete(model="no-such-model", prompt="x", max_tokens=4)
        with self.assertRaises(openai.NotFoundError):
            self.client.chat.completions.create(model="no-such-model", max_tokens=4,
                                                messages=[{"role": "user", "content": "x"}])

    def test_auth_and_rate_limit_on_a_second_router(self):
        """`cleave router` on the same workers with API keys and router.max_queue=2."""
        import openai
        proc = h.router(self.serve, "--set", "router.api_keys=key-one, key-two",
                        "--set", "router.max_queue=2")
        try:
            with self.assertRaises(openai.AuthenticationError):
                h.client(proc, api_key="wrong").completions.create(
                    model=self.model, prompt="x", max_tokens=4)
            # No Authorization header at all: 401 with an OpenAI error object.
            status, body = proc.post("/v1/completions", {"prompt": "x", "max_tokens": 4})
            self.assertEqual(status, 401, body)
            self.assertEqual(json.loads(body)["error"]["code"], "invalid_api_key")
            # /health and /metrics stay open for probes and scrapers.
            self.assertEqual(proc.get("/health")[0], 200)
            self.assertEqual(proc.get("/metrics")[0], 200)
            good = h.client(proc, api_key="key-two")
            r = good.completions.create(model=self.model, prompt="", max_tokens=200,
                                        temperature=0)
            self.assertEqual(r.choices[0].text, h.golden_text())

            # 12 concurrent long requests against a queue of two: some get 429.
            barrier = threading.Barrier(12)

            def one(i):
                barrier.wait()
                try:
                    good.completions.create(model=self.model, prompt="", max_tokens=300,
                                            temperature=0.8, seed=i,
                                            extra_body={"ignore_eos": True})
                    return "ok"
                except openai.RateLimitError:
                    return "429"

            with concurrent.futures.ThreadPoolExecutor(12) as pool:
                outcomes = list(pool.map(one, range(12)))
            self.assertIn("429", outcomes)
            self.assertIn("ok", outcomes)
            self.assertLessEqual(outcomes.count("ok"), 11)
        finally:
            proc.stop()


if __name__ == "__main__":
    h.harness_main()
