"""The seeds' experiments, reproduced and predicted."""
