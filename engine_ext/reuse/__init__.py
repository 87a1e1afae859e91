"""Reuse of KV across requests beyond the prefix cache: segment alignment, assembly of
cached segments at new positions (the methods in `methods.py`), the reuse prefill, and
the ReuseLifecycle (`lifecycle.py`) that owns a request's reuse from admission to the
release of every cache pin it holds (`locks.py`)."""
