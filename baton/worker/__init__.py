"""What every serving process shares: flags, logs, health, metrics, READY, signals
(`process`), the engine's thread (`async_engine`), proto translations (`wire`) and the
health probe command (`python -m baton.worker.healthcheck`)."""
