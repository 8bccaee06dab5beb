"""End-to-end: the embedded default model, SmolLM2-135M-Instruct (Q4_1), as scripts/install-deps.sh
puts it into the model cache. `cleave serve` with no model serves it disaggregated, named
SmolLM2-135M-Instruct; the official `openai` client asks it real questions; `cleave generate`
with no model continues "The capital of France is" with " Paris.".

Skips (77) with a message when the file is not in the cache, or when this build cannot load it
yet (Q4_1 weights).

Usage: python3 serve_default_model_test.py CLEAVE_BINARY MODELS_DIR
"""

import os
import subprocess
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import serve_harness as h  # noqa: E402

NAME = "SmolLM2-135M-Instruct"
FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir():
    """As src/model/default_model.cpp: default_model_cache_dir()."""
    for var, suffix in (("CLEAVE_CACHE_DIR", ""), ("XDG_CACHE_HOME", "/cleave"),
                        ("HOME", "/.cache/cleave")):
        v = os.environ.get(var)
        if v:
            return v + suffix
    return "/tmp/cleave-cache"


def generate(prompt, max_tokens):
    env = {k: v for k, v in os.environ.items() if k != "CLEAVE_MODEL_PATH"}
    return subprocess.run([h.CLEAVE, "generate", "--prompt", prompt, "--temperature", "0",
                           "--max-tokens", str(max_tokens), "--threads", "2"],
                          capture_output=True, text=True, timeout=180, env=env)


class DefaultModelTest(unittest.TestCase):
    serve = None

    @classmethod
    def setUpClass(cls):
        args = ["serve", "--host", "127.0.0.1", "--port", "0", "--grpc-port", "0",
                "--set", "router.health_interval_ms=200",
                "--set", "pools.prefill.kv_cache_bytes=67108864",
                "--set", "pools.decode.kv_cache_bytes=67108864"]
        cls.serve = h.Process(args, "serve-default", start_timeout=180)
        cls.client = h.client(cls.serve, timeout=180)

    @classmethod
    def tearDownClass(cls):
        if cls.serve is not None:
            cls.serve.stop()

    def test_served_under_its_name(self):
        self.assertEqual([m.id for m in self.client.models.list().data], [NAME])

    def test_greedy_completion_knows_the_capital_of_france(self):
        r = self.client.completions.create(model=NAME, prompt="The capital of France is",
                                           max_tokens=3, temperature=0)
        self.assertTrue(r.choices[0].text.startswith(" Paris."), repr(r.choices[0].text))

    def test_generate_without_a_model_uses_it(self):
        out = generate("The capital of France is", 3)
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertTrue(out.stdout.startswith(" Paris."), repr(out.stdout))

    def chat(self, question, **kw):
        kw.setdefault("temperature", 0)
        kw.setdefault("max_tokens", 64)
        return self.client.chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": question}], **kw)

    def test_chat_answers_and_stops_at_the_end_of_its_turn(self):
        r = self.chat("What is the capital of Germany?")
        c = r.choices[0]
        self.assertIn("Berlin", c.message.content)
        self.assertEqual(c.finish_reason, "stop")  # at <|im_end|>, not at max_tokens
        self.assertLess(r.usage.completion_tokens, 64)
        for special in ("<|im_end|>", "<|im_start|>", "<|endoftext|>"):
            self.assertNotIn(special, c.message.content)

    def test_chat_streaming_with_defaults(self):
        # The default temperature (1), a fixed seed: it still ends its turn.
        stream = self.client.chat.completions.create(
            model=NAME, stream=True, seed=7, max_tokens=256,
            messages=[{"role": "system", "content": "You answer in one short sentence."},
                      {"role": "user", "content": "What color is the sky on a clear day?"}])
        text, finish = "", None
        for chunk in stream:
            for ch in chunk.choices:
                text += ch.delta.content or ""
                finish = ch.finish_reason or finish
        self.assertEqual(finish, "stop")
        self.assertTrue(text.strip(), "an empty answer")
        self.assertNotIn("<|im_end|>", text)


def main():
    if len(sys.argv) < 3:
        print(f"usage: {sys.argv[0]} CLEAVE_BINARY MODELS_DIR", file=sys.stderr)
        sys.exit(2)
    h.CLEAVE, h.MODELS = sys.argv[1], sys.argv[2]
    del sys.argv[1:3]
    path = os.path.join(cache_dir(), FILE)
    if not os.path.isfile(path):
        print(f"SKIP: {path} is absent (scripts/install-deps.sh puts it there)", file=sys.stderr)
        sys.exit(h.SKIP)
    probe = subprocess.run([h.CLEAVE, "generate", "--model", path, "--prompt", "Hi",
                            "--max-tokens", "1", "--threads", "1"],
                           capture_output=True, text=True, timeout=180)
    if probe.returncode != 0:
        print(f"SKIP: this build cannot run {path} yet: {probe.stderr.strip()[-300:]}",
              file=sys.stderr)
        sys.exit(h.SKIP)
    try:
        import openai  # noqa: F401
    except ImportError:
        print("FAIL: the Python package `openai` is missing; run scripts/install-deps.sh",
              file=sys.stderr)
        sys.exit(1)
    unittest.main(verbosity=2)


if __name__ == "__main__":
    main()
