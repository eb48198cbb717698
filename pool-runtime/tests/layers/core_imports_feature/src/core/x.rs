//! A core file. [`Graph`](crate::graph::Graph) in a doc comment is no import.
use crate::graph::Graph;

#[cfg(test)]
mod tests {
    use crate::graph::Graph;
}
