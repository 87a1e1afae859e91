"""KVCOMM (engine side): anchor pools that learn how a shared text's KV shifts behind
each agent's prefix, and predict that offset for new samples instead of recomputing."""

from engine_ext.kvcomm.anchors import AgentOffsets, Anchor, AnchorPool, SampleIdentity
from engine_ext.kvcomm.bank import AnchorBank, Decision, Measurement
from engine_ext.kvcomm.criterion import Prediction, predict
from engine_ext.kvcomm.offsets import ChunkedCorrection, Correction

__all__ = ["AgentOffsets", "Anchor", "AnchorBank", "AnchorPool", "ChunkedCorrection", "Correction", "Decision", "Measurement",
           "Prediction", "SampleIdentity", "predict"]
