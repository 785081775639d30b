"""Engines: what runs a net over a batch of experience rows. A training engine (`train`) owns a net that learns
(its layout, optimizer, SPMD or pipeline train step, micro-batch sizing, learning-rate schedule and non-finite
policy); a forward engine (`forward`) runs a scoring cell, plain or through pipeline stages, over sized
micro-batches. The trainer's roles are compositions of engines."""
