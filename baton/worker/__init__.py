"""What every serving process shares: the process entry, logs, signals and the READY line
(`process`, light enough for the gateway), the worker flags and configs (`flags`), the one
start path of a worker role (`start`), the engine's thread (`async_engine`), proto
translations (`wire`), the GetStats RPC (`stats_rpc`) and the health probe command
(`python -m baton.worker.healthcheck`)."""
