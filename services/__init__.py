"""keepwarm: LLM chat serving that never prefills the same prefix twice."""
