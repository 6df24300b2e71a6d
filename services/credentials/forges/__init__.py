"""The forges (GitHub, a local one) behind one interface: pull requests, checks, repository
events and the marks afe leaves on comments."""
