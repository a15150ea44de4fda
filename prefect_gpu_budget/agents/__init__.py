"""The agents' door: the gateway (REST and MCP) and the rules of what an agent may do."""
