"""OpenTelemetry exporters chosen by the OTEL_* variables, for the gateway and the engine.

- OTEL_TRACES_EXPORTER: comma list of `otlp`, `console`, `none`. Unset means `otlp` when
  an OTLP endpoint is configured (OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT) and `none`
  otherwise, so a service without a collector does not log export failures forever.
- OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL: `http/protobuf` (default) or `grpc`.
- OTEL_SERVICE_NAME / OTEL_RESOURCE_ATTRIBUTES name the resource; the OTLP exporters
  read their endpoint, headers and timeout from the standard variables themselves.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter


class TracingConfigError(ValueError):
    """An OTEL_* variable names something kvrelay cannot export to."""


def _otlp_exporter(env: Mapping[str, str]) -> SpanExporter:
    protocol = env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "http/protobuf"
    if protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter
        return HttpExporter()
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter
        return GrpcExporter()
    raise TracingConfigError(f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol!r}: use http/protobuf or grpc")


_EXPORTERS: dict[str, Callable[[Mapping[str, str]], SpanExporter]] = {
    "otlp": _otlp_exporter,
    "console": lambda env: ConsoleSpanExporter(),
}


def build_provider(env: Mapping[str, str] | None = None, default_service: str = "kvrelay") -> TracerProvider | None:
    """The provider the OTEL_* variables ask for, or None when nothing is exported."""
    env = os.environ if env is None else env
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    names = env.get("OTEL_TRACES_EXPORTER")
    if names is None:
        has_endpoint = env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        names = "otlp" if has_endpoint else "none"
    exporters = []
    for name in (n.strip() for n in names.split(",")):
        if name in ("", "none"):
            continue
        if name not in _EXPORTERS:
            raise TracingConfigError(f"OTEL_TRACES_EXPORTER: unknown exporter {name!r} (use otlp, console or none)")
        exporters.append(_EXPORTERS[name](env))
    if not exporters:
        return None
    provider = TracerProvider(resource=Resource.create({"service.name": env.get("OTEL_SERVICE_NAME", default_service)}))
    for exporter in exporters:
        provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider
