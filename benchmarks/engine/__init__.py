"""What does the plugin cost vLLM's engine core, and what does it hold in memory?"""
