"""`python -m marl_llm ...`: what `torchrun -m marl_llm` and `accelerate launch -m marl_llm` run."""

from marl_llm.cli.launch import main

if __name__ == "__main__":
    main()
