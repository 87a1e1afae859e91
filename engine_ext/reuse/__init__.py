"""Reuse of KV across requests beyond the prefix cache: segment alignment, assembly of
cached segments at new positions (shift, blend, link), and the reuse prefill."""
