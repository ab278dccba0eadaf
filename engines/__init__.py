"""Real inference engines in the loop: install, model building and launch of real vLLM.

Nothing here is imported by the gateway or the reference backend; `tokengate up --engine vllm`
and the compatibility tests use it. The code that runs *inside* vLLM's own virtual environment
(`model.py`, `launch.py`, `requirements.py`) imports nothing from this project.
"""
