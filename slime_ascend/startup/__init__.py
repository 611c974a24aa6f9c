"""What runs as a process of slime's loop starts: the bootstrap, the validation where each role first holds
``args``, and the plan that installs the declared runtime patches at their moment."""
