"""The kvrelay KV connector for vLLM (KVConnectorBase_V1), and the parts it is made of.

vLLM loads it with
`--kv-transfer-config '{"kv_connector": "KvrelayConnector",
"kv_connector_module_path": "engine_ext.vllm.connector", "kv_role": "kv_both",
"kv_load_failure_policy": "recompute", "kv_connector_extra_config": {...}}'`
(see `ConnectorConfig` for the extra keys, `server.connector_transfer_config`).

What runs inside vLLM: the gateway's plan (kv_transfer_params["kvrelay"]) names each
agent's fixed prefix and the workflow's steps-to-execution. The connector keeps the full
blocks of every fixed prefix in its own host (tmpfs) and disk tiers, orders evictions
and host/disk placement by KVFlow's priorities (engine_ext.tiers.WorkflowPolicy over a
WorkflowTable), moves the prefixes of the agents due within `load_ahead` steps from disk
to host (prefetch), and when vLLM's own prefix cache no longer holds a prefix, loads
its blocks into vLLM's cache instead of letting vLLM recompute them.

What needs the embedded engine: every non-prefix method (shift, blend, link, KVCOMM
anchors, TokenDance collective reuse, ICaRus decoding). The V1 connector API lets a
connector supply the KV of a prompt's leading tokens only; placing cached KV at another
position, correcting it, or running a second query stream needs hooks inside vLLM's
model and attention that it does not expose.

Only `connector` imports vLLM; the rest is plain kvrelay code, tested without vLLM.
"""
