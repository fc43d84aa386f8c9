"""Loading and serving: the model, the proposer and the engine for ``treespec serve``."""

from __future__ import annotations

import signal
import threading
import time

import uvicorn

from treespec.api import _default_eos
from treespec.auto import auto_proposer
from treespec.bench.e2e import BenchConfig, Components
from treespec.engine.loop import Engine
from treespec.proposers.routed import RoutedProposer
from treespec.serve import ServeConfig
from treespec.serve.app import ServerConfig, build_app
from treespec.serve.runner import EngineRunner
from treespec.target.cache import default_max_len


def build(config: ServeConfig):
    """The app and its runner (not started), the model loaded and the proposer built as
    ``treespec bench`` builds it (the adaptive budget calibrated on this machine)."""
    parts = Components(BenchConfig(model=config.model, proposers=("none",), baselines=(), dtype=config.dtype,
                                   batch_size=config.max_batch, budget=config.budget))  # fmt: skip
    target = parts.target
    max_len = config.max_model_len or default_max_len(target.max_context)
    if target.max_context is not None and max_len > target.max_context:
        raise ValueError(f"max_model_len {max_len} exceeds the model's context of {target.max_context}")
    names, router = config.proposers, None
    if len(names) > 1:  # each request drafted by the member it names (the first by default)
        proposer = router = RoutedProposer({name: parts.proposer(name) for name in names}, default=names[0])
    elif config.proposer == "auto":
        proposer = auto_proposer(parts.model, batch_size=config.max_batch, target=target, max_len=max_len)
    elif config.proposer == "none":
        proposer = None
    else:
        proposer = parts.proposer(config.proposer)
    engine = Engine(target, max_batch_size=config.max_batch, max_len=max_len, prefill_chunk_size=config.prefill_chunk,
                    proposer=proposer, max_prefill_tokens=config.max_prefill_tokens)  # fmt: skip
    runner = EngineRunner(engine, names[0] if proposer is not None else "none", router)
    name = config.served_model_name or config.model
    server = ServerConfig(name, tuple(_default_eos(parts.model)), max_len, target.vocab_size, config.api_key,
                          names if proposer is not None else ())  # fmt: skip
    return build_app(runner, parts.tokenizer, server), runner


def serve(config: ServeConfig) -> None:
    """Load, then serve until interrupted: the engine steps on the main thread (PyTorch's
    operators are several times dearer on another: :meth:`EngineRunner.run`), the HTTP side runs
    on a thread of its own."""
    app, runner = build(config)
    server = uvicorn.Server(uvicorn.Config(app, host=config.host, port=config.port, log_level="warning"))
    http = threading.Thread(target=server.run, name="treespec-http", daemon=True)
    http.start()
    while not server.started and http.is_alive():
        time.sleep(0.05)
    if not server.started:  # the port was taken, or the app failed to start: uvicorn said why
        raise SystemExit(f"treespec: the server could not start on {config.host}:{config.port}")
    print(f"treespec: serving {config.served_model_name or config.model} on http://{config.host}:{config.port}/v1 "
          f"(proposer {config.proposer}, up to {config.max_batch} requests at once)", flush=True)  # fmt: skip

    def stop(signum, frame) -> None:  # SIGTERM ends the server as Ctrl-C does
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    try:
        runner.run()
    except KeyboardInterrupt:
        pass
    finally:
        server.should_exit = True
        http.join(timeout=10)
        runner.close()
