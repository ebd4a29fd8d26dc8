"""What runs in the agent process: torchrun's agent, warm spares, how many trainers a machine launches."""
