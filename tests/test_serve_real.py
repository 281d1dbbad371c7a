"""`treespec serve` over the real SmolLM2-135M and its shipped eagle3 head: greedy chat over HTTP
(the openai client, streamed) equals `treespec generate` on the same prompt."""

from __future__ import annotations

import pytest
import torch

from _serve_helpers import live_server

openai = pytest.importorskip("openai")


def test_greedy_chat_over_http_equals_treespec_generate_on_smollm2() -> None:
    from treespec import DynamicTreeBuilder, SpeculativeGenerator, SpeculativeServer, load_target
    from treespec.cli.serve.app import make_app

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        target = load_target("smollm2-135m")
        builder = DynamicTreeBuilder(budget=8, depth=4, top_k=2)
        prompt = "What is the capital of France?"
        want = SpeculativeGenerator(target, "eagle3", builder).generate(prompt, 24).text
        app = make_app(SpeculativeServer(target, "eagle3", builder), "smollm2-135m")
        with live_server(app) as url:
            client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=120)
            parts = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
                model="smollm2-135m", messages=[{"role": "user", "content": prompt}], max_tokens=24, temperature=0,
                stream=True) if c.choices]
        assert "".join(parts) == want and want
        assert app.state.front.server.stats.tau > 1.0          # the head's drafts were accepted
    finally:
        torch.set_num_threads(before)
