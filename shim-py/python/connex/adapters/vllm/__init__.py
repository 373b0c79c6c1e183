"""vLLM adapter: the ConnexConnector KV connector (see `pd_connector`)."""
