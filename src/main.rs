//! `hindsight`: the one binary; each subcommand calls into a library crate.
fn main() {
    println!("hindsight: subcommands arrive with the crates that implement them");
}
