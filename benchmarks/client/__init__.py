"""What does the hook cost an agent's calls and memory?"""
