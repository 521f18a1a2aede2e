"""`baton up`: a local cluster of gateway, prefill and decode processes (`up`)."""
