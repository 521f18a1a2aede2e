"""`baton up`: a local cluster of gateway, prefill and decode processes: the supervisor and
its flags (`up`), one child process (`child`), what each child runs with (`plan`)."""
