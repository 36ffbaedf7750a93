"""What do agents gain, side by side with vanilla vLLM, on real servers and traces?"""
