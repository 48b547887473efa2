"""The training loop: orders the roles (rollout, reward, reference, advantage, train,
sync), owns no maths."""
