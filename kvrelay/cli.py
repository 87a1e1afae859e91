"""The `kvrelay` command line. Each command reports bad input as one line and exit code 2."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, help="kvrelay: KV-cache reuse for multi-agent LLM apps.")


def _fail(message: str) -> typer.Exit:
    typer.echo(f"kvrelay: error: {message}", err=True)
    return typer.Exit(code=2)


@app.command()
def engine(
    model: Annotated[Optional[str], typer.Option(help="HF-format model directory (default: SmolLM2-135M-Instruct, prepared on first use)")] = None,
    host: Annotated[str, typer.Option(help="address to bind")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=1, max=65535)] = 8000,
    served_model_name: Annotated[Optional[str], typer.Option(help="model id clients send (default: the directory name)")] = None,
    kv_cache_mb: Annotated[int, typer.Option(min=1, help="KV cache budget in MiB (stands for GPU memory)")] = 512,
    block_size: Annotated[int, typer.Option(min=1, max=1024)] = 16,
    max_num_seqs: Annotated[int, typer.Option(min=1)] = 64,
    max_num_batched_tokens: Annotated[int, typer.Option(min=1)] = 2048,
    max_model_len: Annotated[Optional[int], typer.Option(min=2)] = None,
    dtype: Annotated[str, typer.Option(help="float32 | bfloat16 | float16")] = "float32",
    log_level: Annotated[str, typer.Option()] = "info",
) -> None:
    """Serve one model over the OpenAI API with kvrelay's embedded engine."""
    import uvicorn

    from engine_ext.async_engine import AsyncEngine
    from engine_ext.config import EngineConfig
    from engine_ext.engine import LLMEngine
    from engine_ext.errors import EngineError
    from engine_ext.model_store import resolve_model
    from engine_ext.server import create_app

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = EngineConfig(
            kv_cache_bytes=kv_cache_mb * 2**20, block_size=block_size, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len, dtype=dtype,  # type: ignore[arg-type]
        )
        model_dir = resolve_model(model)
        llm = LLMEngine(model_dir, config, served_model_name or model_dir.name)
    except (EngineError, ValueError) as exc:
        raise _fail(str(exc)) from exc
    typer.echo(
        f"kvrelay engine: serving {llm.model_name} ({llm.kv_cache.num_blocks} KV blocks of "
        f"{block_size} tokens); point an OpenAI client at base_url=http://{host}:{port}/v1"
    )
    uvicorn.run(create_app(AsyncEngine(llm), llm.model_name), host=host, port=port, log_level=log_level)


@app.command("prepare-model")
def prepare_model() -> None:
    """Convert the default model once (happens automatically on first `engine` start)."""
    from engine_ext.errors import EngineError
    from engine_ext.model_store import prepare_default_model

    try:
        typer.echo(prepare_default_model())
    except EngineError as exc:
        raise _fail(str(exc)) from exc


@app.command()
def bench(
    name: Annotated[str, typer.Argument(help="benchmark to run (see `kvrelay bench --help`)")],
    quick: Annotated[bool, typer.Option("--quick", help="small sizes; finishes in under a minute")] = False,
    json_path: Annotated[Optional[Path], typer.Option("--json", help="write the result JSON here")] = None,
    model: Annotated[Optional[str], typer.Option(help="model directory (default model if omitted)")] = None,
) -> None:
    """Run a benchmark: kvrelay and its baseline side by side; prints a table, writes JSON."""
    from benchmarks import BENCHMARKS, run_benchmark

    if name not in BENCHMARKS:
        raise _fail(f"unknown benchmark {name!r}; available: {', '.join(sorted(BENCHMARKS))}")
    try:
        run_benchmark(name, quick=quick, json_path=json_path, model=model)
    except (OSError, ValueError) as exc:
        raise _fail(str(exc)) from exc


def main() -> None:
    """Console entry point: usage errors become one line on stderr, exit code 2."""
    if len(sys.argv) == 1:
        sys.argv.append("--help")
    try:
        result = app(standalone_mode=False)
    except typer.Abort:
        raise SystemExit(130) from None
    except typer.TyperException as exc:
        message = exc.format_message() if hasattr(exc, "format_message") else str(exc)
        typer.echo(f"kvrelay: error: {message}", err=True)
        raise SystemExit(getattr(exc, "exit_code", 2)) from None
    # With standalone_mode=False, typer returns a command's exit code instead of exiting.
    raise SystemExit(result if isinstance(result, int) else 0)
