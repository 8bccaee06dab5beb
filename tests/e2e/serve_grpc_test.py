"""End-to-end: the router's public gRPC API (cleave.v1.Inference) on `cleave serve` with
stories260K, disaggregated, driven by grpcio with stubs generated from
proto/cleave/v1/inference.proto at run time: the greedy completion of an empty prompt equals the
golden text, streaming chat equals the HTTP API's answer for the same seed, errors are statuses
with the error object's fields in the trailing metadata, grpc.health.v1 says SERVING, and a call
cancelled mid-stream leaves every worker's KV blocks free.

Usage: python3 serve_grpc_test.py CLEAVE_BINARY MODELS_DIR
"""

import os
import sys
import tempfile
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import serve_harness as h  # noqa: E402

class ServeGrpcTest(unittest.TestCase):
    serve = None

    @classmethod
    def setUpClass(cls):
        import grpc
        cls.grpc = grpc
        cls.tmp = tempfile.TemporaryDirectory(prefix="cleave-grpc-stubs-")
        cls.pb2, pb2_grpc = h.grpc_stubs(cls.tmp.name, "inference")
        cls.serve = h.serve()
        cls.channel = grpc.insecure_channel(cls.serve.grpc_target())
        cls.stub = pb2_grpc.InferenceStub(cls.channel)
        cls.http = h.client(cls.serve)

    @classmethod
    def tearDownClass(cls):
        if cls.serve is not None:
            cls.channel.close()
            cls.serve.stop()
        cls.tmp.cleanup()

    def generate(self, **fields):
        """(text per choice, finish per choice, usage, messages) of one Generate call."""
        req = self.pb2.GenerateTextRequest(**fields)
        text, finish, usage, messages = {}, {}, None, 0
        for msg in self.stub.Generate(req, timeout=60):
            messages += 1
            for d in msg.choices:
                text[d.index] = text.get(d.index, "") + d.text
                if d.finish_reason:
                    finish[d.index] = d.finish_reason
            if msg.HasField("usage"):
                usage = msg.usage
        return text, finish, usage, messages

    def test_golden_text_of_the_empty_prompt(self):
        text, finish, usage, messages = self.generate(
            prompts=[self.pb2.Prompt(text="")], max_tokens=200, temperature=0)
        self.assertEqual(text[0], h.golden_text())
        self.assertGreater(messages, 1)
        self.assertIn(finish[0], ("stop", "length"))
        self.assertEqual(usage.total_tokens, usage.prompt_tokens + usage.completion_tokens)

    def test_seeded_chat_equals_the_http_api(self):
        msgs = [{"role": "user", "content": "Tell me a story about a cat."}]
        ref = self.http.chat.completions.create(model=self.http.models.list().data[0].id,
                                                messages=msgs, max_tokens=40, temperature=0.9,
                                                seed=77)
        text, finish, usage, _ = self.generate(
            messages=[self.pb2.ChatMessage(role="user", content=msgs[0]["content"])],
            max_tokens=40, temperature=0.9, seed=77)
        self.assertEqual(text[0], ref.choices[0].message.content)
        self.assertEqual(finish[0], ref.choices[0].finish_reason)
        self.assertEqual(usage.completion_tokens, ref.usage.completion_tokens)
        self.assertEqual(usage.prompt_tokens, ref.usage.prompt_tokens)

    def test_errors_are_statuses_with_the_error_fields(self):
        grpc = self.grpc
        with self.assertRaises(grpc.RpcError) as cm:
            self.generate(prompts=[self.pb2.Prompt(text="hi")], temperature=-1)
        err = cm.exception
        self.assertEqual(err.code(), grpc.StatusCode.INVALID_ARGUMENT)
        self.assertIn("temperature", err.details())
        trailers = dict(err.trailing_metadata())
        self.assertEqual(trailers.get("cleave-error-param"), "temperature")
        self.assertEqual(trailers.get("cleave-error-type"), "invalid_request_error")
        with self.assertRaises(grpc.RpcError) as cm:
            self.generate(model="no-such-model", prompts=[self.pb2.Prompt(text="hi")])
        self.assertEqual(cm.exception.code(), grpc.StatusCode.NOT_FOUND)

    def test_health_and_models(self):
        check = self.channel.unary_unary("/grpc.health.v1.Health/Check",
                                         request_serializer=lambda b: b,
                                         response_deserializer=lambda b: b)
        self.assertEqual(check(b"", timeout=10), b"\x08\x01")  # status: SERVING
        models = self.stub.ListModels(self.pb2.ListModelsRequest(), timeout=10)
        self.assertEqual(len(models.models), 1)
        self.assertGreater(models.models[0].max_model_len, 0)

    def test_cancel_mid_stream_frees_every_block(self):
        req = self.pb2.GenerateTextRequest(prompts=[self.pb2.Prompt(text="A long story")],
                                           max_tokens=2000, temperature=0.8, ignore_eos=True)
        call = self.stub.Generate(req, timeout=60)
        got = 0
        for _ in call:
            got += 1
            if got == 3:
                break
        call.cancel()
        cancelled_at = time.monotonic()
        self.assertEqual(got, 3)
        # Settled: the call counted as CANCELLED, and, in a load report taken after the cancel
        # (probes every 200 ms), both pools' KV usage back to 0 with nothing running.
        deadline = cancelled_at + 15
        while True:
            m = self.serve.metrics()
            calls = {dict(labels).get("code"): v for (name, labels), v in m.items()
                     if name == "cleave:grpc_requests_total" and ("method", "Generate") in labels}
            usage = [m.get(("cleave:kv_cache_usage_perc", frozenset({("pool", p)})))
                     for p in ("prefill", "decode")]
            running = m.get(("cleave:num_requests_running", frozenset()))
            if (calls.get("CANCELLED", 0) >= 1 and usage == [0.0, 0.0] and running == 0 and
                    time.monotonic() - cancelled_at > 0.6):
                break
            if time.monotonic() > deadline:
                self.fail(f"not settled 15 s after the cancel: calls {calls}, kv usage {usage}, "
                          f"running {running}")
            time.sleep(0.1)

if __name__ == "__main__":
    try:
        import grpc_tools  # noqa: F401
    except ImportError:
        print("FAIL: the Python package `grpcio-tools` is missing; run scripts/install-deps.sh",
              file=sys.stderr)
        sys.exit(1)
    h.harness_main()
