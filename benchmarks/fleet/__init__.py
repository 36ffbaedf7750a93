"""What happens with several replicas behind a router (nginx, vllm-router)?"""
