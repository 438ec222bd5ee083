"""`mod serve`: an OpenAI-compatible server for MoD (and dense) checkpoints, with continuous
batching and a paged KV cache per routed layer (docs/serving.md).

- `types`: what the HTTP layer and the engine exchange (sampling settings, events, errors);
- `paged`: `PagedKVCache`, a pool of fixed-size pages per layer and a page table per (row,
  layer), behind the model's `Cache` protocol;
- `engine`: `Engine`, the scheduler loop that owns the model: requests join the running batch at
  the next step and leave it the moment they finish;
- `app`: the HTTP API (FastAPI on uvicorn: the `[serve]` extra); `guard`: the host check, the
  API key and the connection limits in front of it; `server`: running it.

The model never imports this package; it uses the library's one forward path.
"""
