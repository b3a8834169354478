"""Talk to serving engines through their HTTP contracts only (DESIGN.md §5).

    bench.py    `draftsmith bench-serve`: load generator for OpenAI-compatible endpoints
    metrics.py  Prometheus /metrics parsing, speculative-decoding acceptance (vLLM, SGLang)
    stub.py     a small OpenAI-compatible server (deterministic stub or a tiny HF model) for
                tests and for trying bench-serve without a GPU
"""
